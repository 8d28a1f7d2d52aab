"""Trainable parameters kept whole on every rank (`shard_model(..., replicate_adapters=True)`): docs/accumulation.md."""

from __future__ import annotations

import contextlib
import functools
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
        # one rank a dimension sends nothing; the innermost ("shard") goes first
        self.groups = [mesh.get_group(i) for i in reversed(range(mesh.ndim)) if mesh.size(i) > 1]
        self.world = mesh.size()
        self.sync = True
        self.queued = -1  # the backward (graph task) whose callback is queued: a failed one never runs it

    def hook(self, _: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if self.sync and task != self.queued:  # once per backward, after every gradient is accumulated
            self.queued = task
            torch.autograd.Variable._execution_engine.queue_callback(self.all_reduce)

    def all_reduce(self) -> None:
        for p in self.params:  # the same layout on every rank: an adapter this rank's batch missed adds zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # a SUM divided by the world: gloo has no AVG
        self._flat_over_groups([p.grad for p in self.params], dist.all_reduce, divide=self.world)

    def _flat_over_groups(self, tensors: list[torch.Tensor], op, divide: int = 1) -> None:
        """``op`` on one flat copy per dtype over each group in turn, divided by ``divide``, copied back."""
        for dtype in dict.fromkeys(t.dtype for t in tensors):  # in first-seen order: the same on every rank
            ts = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in ts])
            for group in self.groups:
                op(flat, group=group)
            flat.div_(divide)  # by 1 (exact) for the broadcast
            for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(part.view_as(t))


def replicate_trainable(model: nn.Module, params: list[nn.Parameter], mesh: DeviceMesh) -> None:
    """Start ``params`` from the first rank's values and average their gradients over ``mesh`` (the
    data-parallel mesh) at the end of each synced backward."""
    state = _Replicated(params, mesh)
    if not any(p.is_meta for p in params):  # on the meta device: materialize draws them alike on every rank
        # every rank starts from the values of the mesh's first rank (as DDP does), whatever each built
        state._flat_over_groups([p.detach() for p in params], functools.partial(dist.broadcast, group_src=0))
    for p in params:
        p.register_post_accumulate_grad_hook(state.hook)
    setattr(model, _STATE, state)


@contextlib.contextmanager
def paused(model: nn.Module, pause: bool = True) -> Iterator[None]:
    """No all-reduce of the replicated gradients inside (they accumulate in ``.grad``); nothing without them."""
    state = getattr(model, _STATE, None) if pause else None
    if state is not None:
        state.sync = False
    try:
        yield
    finally:
        if state is not None:
            state.sync = True
