"""Gradient clipping over sharded parameters, and gradient accumulation without communication."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2kit._internal.dtensor import fsdp_units, local_shard
from fsdp2kit.accumulation import accumulate

__all__ = ["clip_grad_norm_", "no_sync"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by their total norm over every rank's shards; returns that norm, a plain tensor equal on
    every rank, also across meshes (torch's returns a DTensor and cannot mix meshes). A non-finite norm is
    returned as it is, the gradients left unscaled (docs/long-runs.md)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)

    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault((g.device_mesh, g.placements) if isinstance(g, DTensor) else None, []).append(g)
    norms = [torch.nn.utils.get_total_norm(group, norm_type, foreach=None) for group in by_mesh.values()]
    # a DTensor norm is this rank's part: full_tensor reduces it over the shards
    norms = [(n.full_tensor() if isinstance(n, DTensor) else n).to(grads[0].device, torch.float32) for n in norms]
    total = torch.nn.utils.get_total_norm(norms, norm_type)

    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()})")
    clip_coef = torch.where(torch.isfinite(total), (max_norm / (total + 1e-6)).clamp(max=1.0), 1.0)
    for local in map(local_shard, grads):
        local.mul_(clip_coef.to(device=local.device, dtype=local.dtype))
    return total


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Accumulate gradients locally: backward passes inside skip the reduce-scatter/all-reduce (every micro-step
    but the last; gradients are held unsharded meanwhile). Scale each micro-step's loss by 1/N to average."""
    fsdp_units(model, "no_sync")  # its error names this call
    return accumulate(model, "no_sync", 0, 2)  # a micro-batch but the last, replicated adapters paused too
