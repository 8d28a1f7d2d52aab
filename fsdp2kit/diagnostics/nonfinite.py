"""Non-finite loss and gradients: one agreed verdict per step, and the module where it began."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit._internal.fmt import fmt_list

__all__ = ["ON_NONFINITE", "NonFiniteError", "check_finite"]

ON_NONFINITE = ("raise", "skip")


class NonFiniteError(FloatingPointError):
    """The loss or the gradient norm of a step is NaN or infinite (raised on every rank alike)."""

    def __init__(self, message: str, *, step: int, module: str | None):
        super().__init__(message)
        self.step = step
        self.module = module


def _flag(t: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(0.0 if t is None else t, device=device)
    return (~torch.isfinite(t.detach().float())).any().float()


def check_finite(
    model: nn.Module,
    *,
    step: int,
    loss: torch.Tensor | float | None = None,
    grad_norm: torch.Tensor | float | None = None,
    on_nonfinite: str = "raise",
) -> bool:
    """Whether this step's loss (this rank's) and gradient norm (the global one) are finite on every rank; the
    same answer everywhere, from one all-reduce. Call it on every rank after ``backward`` (and `clip_grad_norm_`)
    and before ``optimizer.step()``. If not: ``on_nonfinite="raise"`` raises `NonFiniteError` naming the step,
    the ranks whose loss was not finite and the first module in backward order with a non-finite gradient;
    ``"skip"`` sets the gradients to None and returns False. Why: docs/long-runs.md.
    """
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    device = next((local_shard(p).device for p in model.parameters()), torch.device("cpu"))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0

    def max_over_ranks(t: torch.Tensor) -> list:
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    # Two flags, whatever the world size: this rank's loss, the global norm (MAX over ranks).
    local_loss = _flag(loss, device)
    loss_bad, norm_bad = max_over_ranks(torch.stack([local_loss, _flag(grad_norm, device)]))
    if not (loss_bad or norm_bad):
        return True
    if on_nonfinite == "skip":
        for p in model.parameters():
            p.grad = None
        return False

    # Not finite: the details (two more collectives) only now. Modules with a non-finite gradient of their own.
    names, flags = [], []
    for name, module in model.named_modules():
        names.append(name or "<root>")
        bad = [_flag(local_shard(p.grad), device) for p in module.parameters(recurse=False) if p.grad is not None]
        flags.append(torch.stack(bad).amax() if bad else torch.zeros((), device=device))
    modules = [n for n, f in zip(names, max_over_ranks(torch.stack(flags))) if f]
    per_rank = torch.zeros(world, device=device)
    per_rank[rank] = local_loss
    bad_loss = [r for r, bad in enumerate(max_over_ranks(per_rank)) if bad]
    what = [f"loss on rank{'s' if len(bad_loss) > 1 else ''} {fmt_list(bad_loss)}"] if bad_loss else []
    what += ["gradient norm"] if norm_bad else []
    first = modules[-1] if modules else None
    where = (
        f"the first module in backward order with a non-finite gradient is {first!r}"
        f" ({len(modules)} module{'s' if len(modules) > 1 else ''} affected: {fmt_list(modules[::-1], 6)})"
        if first
        else "every gradient is finite (the loss alone is not)"
    )
    raise NonFiniteError(
        f"step {step}: non-finite {' and '.join(what)}; {where}. Lower the learning rate, check the data of this "
        "step, or skip such steps (on_nonfinite='skip').",
        step=step,
        module=first,
    )
