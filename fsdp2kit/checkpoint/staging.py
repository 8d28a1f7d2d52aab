"""The asynchronous save's staging copy: the state's tensors copied into CPU buffers that live from save to save.

DCP's `DefaultStager` deep-copies the whole state dict on every save, rebuilding every DTensor
(its mesh, its placements, its spec) through ``__deepcopy__`` and ``new_empty``: on the
checkpoint benchmark's small model that rebuilding, not the copy of the bytes, was most of the
time the training loop stalled. `StagingBuffers` keeps, per key of the state dict, a CPU buffer
and (for a DTensor) the DTensor wrapping it, made on the first save; later saves only copy the
bytes into them. A key whose shape, dtype or layout changed gets a new buffer; a key no longer
saved lets its buffer go.

Memory: one copy of what a rank saves (its shards of the parameters and the optimizer state, not
the gradients or activations), pinned on CUDA so the device-to-host copy runs at full speed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp2kit._internal.dtensor import local_shard

__all__ = ["StagingBuffers"]


def _signature(t: torch.Tensor) -> tuple:
    local = local_shard(t)
    spec = (t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride())) if isinstance(t, DTensor) else None
    return (tuple(local.shape), tuple(local.stride()), local.dtype, spec)


class StagingBuffers:
    """Copies a (nested) state dict's tensors into reused CPU buffers; other values are deep-copied."""

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self._staged: dict[tuple, tuple[tuple, torch.Tensor]] = {}  # path -> (signature, staged tensor)

    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this object's buffers (valid until the next call)."""
        seen: set[tuple] = set()
        out = self._copy(state, (), seen)
        for path in set(self._staged) - seen:  # keys no longer saved: free their buffers
            del self._staged[path]
        return out

    def close(self) -> None:
        self._staged.clear()

    def _copy(self, value: Any, path: tuple, seen: set) -> Any:
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k), seen) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, (*path, i), seen) for i, v in enumerate(value))
        if isinstance(value, torch.Tensor):
            seen.add(path)
            return self._tensor(value, path)
        return copy.deepcopy(value)

    def _tensor(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        signature = _signature(t)
        cached = self._staged.get(path)
        if cached is not None and cached[0] == signature:
            staged = cached[1]
            local_shard(staged).copy_(local_shard(t).detach())
            return staged
        local = local_shard(t).detach()
        # Same strides as the source (empty_strided), so DCP writes the same layout it would
        # have written from the live tensor.
        buffer = torch.empty_strided(
            local.shape, local.stride(), dtype=local.dtype, device="cpu", pin_memory=self.pin_memory
        )
        buffer.copy_(local)
        # A DTensor keeps its spec around the CPU buffer (from_local would move it to the mesh's device).
        staged = DTensor(buffer, t._spec, requires_grad=False) if isinstance(t, DTensor) else buffer
        self._staged[path] = (signature, staged)
        return staged
