"""LiveBytes: the bytes of tensor storage alive at every op, and the peak, on any device (meta tensors too).

It counts storages, not tensors (views are free) and not the allocator (no caching, no
fragmentation): on CPU that is the figure the planner predicts, and on CUDA it is what
``torch.cuda.max_memory_allocated`` reports minus the allocator's rounding. A storage is counted
from the op that first returns it (or from `track`, for tensors made before the mode) until it
is freed; a storage resized in place (FSDP2 frees unsharded parameters with ``resize_(0)``) is
counted at its current size, re-read at every op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """A dispatch mode that keeps ``live`` (bytes now), ``peak`` and ``on_peak`` callbacks.

    ``on_peak(live)`` runs whenever a new peak is reached, so a caller can classify what is
    alive at that moment; ``label`` is a free-form phase name that the caller updates (the
    phase of the peak is kept in ``peak_label``).
    """

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
        self.live = 0
        self.peak = 0
        self.peak_label = ""
        self.label = ""
        self.on_peak = on_peak

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that exist already (parameters, optimizer state) from now on."""
        for t in tensors:
            if t is not None:
                self._track(t)
        self.update()

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (they must outlive the mode: ids are not reused while alive)."""
        for t in tensors:
            self._ignored.add(id(t.untyped_storage()))

    def _track(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if type(t) is not torch.Tensor and not hasattr(t, "untyped_storage"):
            return
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage of their own
            return
        key = id(st)
        if key in self._storages or key in self._ignored:
            return
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
            self.peak_label = self.label
            if self.on_peak is not None:
                self.on_peak(self.live)
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let DTensor turn itself into local-tensor ops first: those allocate, it does not.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        self.update()
        return out
