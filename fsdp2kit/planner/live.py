"""LiveBytes: tensor storage bytes alive at every op and their peak, on any device (docs/internals.md, live.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_map_only

__all__ = ["LiveBytes", "tensor_storages"]


def tensor_storages(t: torch.Tensor | None) -> list[torch.UntypedStorage]:
    """The storages that hold ``t``'s bytes: a DTensor's local shard's, a wrapper subclass's (NF4) inner
    tensors' (its own ``untyped_storage()`` is sized for its outer shape and holds no memory)."""
    if t is None:
        return []
    if isinstance(t, DTensor):
        return tensor_storages(t._local_tensor)
    if is_traceable_wrapper_subclass(t):
        return [s for n in t.__tensor_flatten__()[0] for s in tensor_storages(getattr(t, n))]
    try:
        return [t.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # a subclass with no storage and no inner tensors
        return []


class LiveBytes(TorchDispatchMode):
    """A dispatch mode that keeps ``live`` (bytes now) and ``peak``; ``on_peak(live)`` runs at each new peak,
    ``on_op(live)`` after every op. ``label`` is a phase name for the caller to set and read."""

    def __init__(
        self,
        on_peak: Callable[[int], None] | None = None,
        *,
        on_op: Callable[[int], None] | None = None,
        incremental: bool = False,
    ):
        super().__init__()
        # incremental: add a storage's bytes once, subtract them when it dies. Exact when nothing
        # is resized in place (a fake-tensor trace), and O(1) an op instead of O(live storages).
        self.incremental = incremental
        self.on_op = on_op
        self._storages: dict[int, weakref.ref] = {}
        self._ignored: set[int] = set()
        self.live = self.peak = 0
        self.label = ""
        self.on_peak = on_peak

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that exist already (parameters, optimizer state) from now on."""
        for t in tensors:
            self._track(t)
        self.update()

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (they must outlive the mode: ids are not reused while alive)."""
        for t in tensors:
            self._ignored.update(id(st) for st in tensor_storages(t))

    def _track(self, t: torch.Tensor | None) -> None:
        for st in tensor_storages(t):
            key = id(st)
            if key in self._storages or key in self._ignored:
                continue
            if self.incremental:
                n = st.nbytes()
                self.live += n
                self._storages[key] = weakref.ref(st, lambda _, key=key, n=n: self._drop(key, n))
            else:
                self._storages[key] = weakref.ref(st, lambda _, key=key: self._storages.pop(key, None))

    def _drop(self, key: int, n: int) -> None:
        self._storages.pop(key, None)
        self.live -= n

    def storages(self) -> list[torch.UntypedStorage]:
        return [s for s in (r() for r in list(self._storages.values())) if s is not None]

    def update(self) -> int:
        if not self.incremental:
            self.live = sum(s.nbytes() for s in self.storages())
        if self.on_op is not None:
            self.on_op(self.live)
        if self.live > self.peak:
            self.peak = self.live
            if self.on_peak is not None:
                self.on_peak(self.live)
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let DTensor (and NF4Tensor, any wrapper subclass) turn itself into ops on its inner
        # tensors first: those allocate (a dequantized weight's temporaries too), it does not.
        if any(issubclass(t, DTensor) or is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        self.update()
        return out
