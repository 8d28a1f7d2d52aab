"""The loss on answer tokens: a mean over the answer tokens of the global batch, across ranks and micro-steps."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2kit as fk
from support.formats import IGNORE

__all__ = ["answer_loss_sum", "answer_tokens", "backward_global_mean"]


def answer_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of the cross-entropy over the batch's answer tokens (labels already shifted, -100 elsewhere).

    ``use_cache=False`` matters: with a cache object, transformers skips its packed-sequence
    detection and packed examples would attend to each other (checked by the tests).
    """
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return F.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum"
    )


def answer_tokens(batches: list[dict[str, torch.Tensor]], device) -> torch.Tensor:
    """The answer tokens in ``batches`` summed over every rank (one all-reduce)."""
    n = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
    t = torch.tensor(float(n), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def backward_global_mean(
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    dp_size: int,
    device,
    before_micro: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    accumulation: str = "no_sync",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of (sum of every rank's answer-token losses) / (global answer-token count).

    The count is taken first over all micro-batches of the step on all ranks, so a rank (or a
    micro-batch) with few answer tokens weighs by its tokens, not as much as one with many, which is
    what a mean of per-rank means would do. FSDP averages gradients over the ``dp_size``
    data-parallel ranks and accumulation adds micro-steps, hence each micro-loss is scaled by
    dp_size / count. ``before_micro(i, batch)`` is called before each micro-step (the recipe's rank
    monitor records where it is). ``accumulation`` is the `fsdp2kit.accumulate` policy of the micro-steps
    (``"no_sync"``: reduce once, on the last). Returns (this rank's loss sum, the global count), both detached.
    """
    count = answer_tokens(micro_batches, device)
    scale = dp_size / count.clamp(min=1.0).item()
    total = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        if before_micro is not None:
            before_micro(i, batch)
        with fk.accumulate(model, accumulation, i, len(micro_batches)):
            s = answer_loss_sum(model, batch)
            (s * scale).backward()
        total += s.detach()
    return total, count
