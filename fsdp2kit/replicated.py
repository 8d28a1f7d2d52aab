"""Trainable parameters kept whole on every rank (`shard_model(..., replicate_adapters=True)`): left out
of ``fully_shard``, their gradients averaged over the data-parallel ranks at the end of a synced backward.

Why and what it costs: docs/accumulation.md, "LoRA: adapters replicated".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["check_replicable", "paused", "replicate_trainable"]

_STATE = "_fsdp2kit_replicated"


def check_replicable(model: nn.Module, cpu_offload: bool = False) -> list[nn.Parameter]:
    """The trainable parameters to replicate: there must be some, beside a frozen base, and none a DTensor."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if not trainable or len(trainable) == len(params):
        raise ValueError(
            "replicate_adapters=True keeps the trainable adapters whole and shards the frozen base: "
            f"{type(model).__name__} has {len(trainable)} trainable of {len(params)} parameters "
            "(expected a LoRA / QLoRA model: some frozen, some trainable)"
        )
    if cpu_offload:
        raise ValueError("replicate_adapters=True with cpu_offload=True: replicated adapters stay on the device")
    if any(isinstance(p, DTensor) for p in trainable):
        raise ValueError("replicate_adapters=True: the trainable parameters are already DTensors (tensor parallel)")
    return trainable


class _Replicated:
    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh) -> None:
        self.params = params
        # one rank a dimension sends nothing; the innermost ("shard") goes first (reversed below)
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim) if mesh.size(i) > 1]
        self.world = mesh.size()
        self.sync = True
        self.queued = False

    def hook(self, _: torch.Tensor) -> None:
        if self.sync and not self.queued:  # once per backward, after every gradient is accumulated
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.all_reduce)

    def all_reduce(self) -> None:
        self.queued = False
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p)
        for ps in by_dtype.values():  # one bucket per dtype: one call per group
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            for group in reversed(self.groups):
                dist.all_reduce(flat, group=group)  # SUM then divide: gloo has no AVG
            flat.div_(self.world)
            for p, g in zip(ps, flat.split([p.numel() for p in ps])):
                p.grad.copy_(g.view_as(p.grad))


def replicate_trainable(model: nn.Module, params: list[nn.Parameter], mesh: DeviceMesh) -> None:
    """Average ``params``' gradients over ``mesh`` (the data-parallel mesh) at the end of each synced backward."""
    state = _Replicated(params, mesh)
    for p in params:
        p.register_post_accumulate_grad_hook(state.hook)
    setattr(model, _STATE, state)


@contextlib.contextmanager
def paused(model: nn.Module, pause: bool = True) -> Iterator[None]:
    """No all-reduce of the replicated gradients inside (they accumulate in ``.grad``); nothing without them."""
    state = getattr(model, _STATE, None)
    if state is None or not pause:
        yield
        return
    state.sync = False
    try:
        yield
    finally:
        state.sync = True


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    state = getattr(model, _STATE, None)
    return [] if state is None else state.params
