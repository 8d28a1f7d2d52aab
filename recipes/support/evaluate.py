"""Held-out evaluation: the split sharded over ranks (each row on exactly one), loss and perplexity of the whole."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from support.formats import IGNORE
from support.loader import to_batch
from support.loss import answer_loss_sum

__all__ = ["eval_batches", "eval_shard", "evaluate"]


def eval_shard(n_rows: int, rank: int, world_size: int) -> range:
    """This rank's held-out rows: every world_size-th, so the shards partition the split (no duplicates)."""
    return range(rank, n_rows, world_size)


def eval_batches(rows, batch_size: int, *, rank: int, world_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's held-out rows in batches; every rank yields the same number of batches (a sharded
    model's forward is collective), the short ones topped up by rows whose every label is -100."""
    mine = eval_shard(len(rows), rank, world_size)
    steps = -(-len(eval_shard(len(rows), 0, world_size)) // batch_size)  # rank 0 has the most rows
    for s in range(steps):
        take = list(mine[s * batch_size : (s + 1) * batch_size])
        if take:
            yield to_batch(rows[take])
        else:
            row = rows[[0]]
            yield to_batch({**row, "labels": [[IGNORE] * len(row["labels"][0])]})


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    rows,
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    device,
    split: Callable[[dict], dict] | None = None,
) -> dict[str, float]:
    """Mean answer-token loss over the whole held-out split and its perplexity; collective, equal on every rank.
    ``split``: context parallelism's cut of each batch to this rank's part of the sequences."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, answer tokens
    for batch in eval_batches(rows, batch_size, rank=rank, world_size=world_size):
        batch = {k: v.to(device) for k, v in batch.items()}
        if split is not None:
            batch = split(batch)
        sums[0] += answer_loss_sum(model, batch).double()
        sums[1] += (batch["labels"] != IGNORE).sum()
    if world_size > 1 or split is not None:  # the cp ranks of one group hold different tokens
        dist.all_reduce(sums)
    model.train(was_training)
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(sums[1].item())}
