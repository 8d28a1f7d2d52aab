"""An asynchronous save's staging step: after the first save, only byte copies through a cached mapping.

The training loop stalls for whatever `Checkpointer.save` does before it hands the state to its
writer thread. Building the state dict (``get_model_state_dict`` and
``get_optimizer_state_dict`` walk every module and map every parameter to its FQN) cost more
than copying the bytes on the checkpoint benchmark's small model. A training run saves the same
tensors again and again, so `Restager` builds the state dict once, stages it into
`StagingBuffers`, and remembers which live tensor (a parameter, a buffer, an optimizer state)
each staging buffer copies. A later save checks that the model and optimizer still hold the
same tensor objects, over the same memory (data pointer, shape, strides, dtype), with the same
``requires_grad`` flags and param groups, and then only copies bytes; anything else (a
parameter replaced, an optimizer state created or reloaded, a frozen parameter thawed) takes
the full path again and rebuilds the mapping. The optimizer's hyper-parameters (which a
scheduler changes) and its 0-d states (Adam's ``step``) are read afresh on every save, and
``extra`` is encoded afresh, so nothing saved is ever stale.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit.checkpoint.extras import encode
from fsdp2kit.checkpoint.optim import FORMAT, PACKED, optimizer_parts
from fsdp2kit.checkpoint.staging import StagingBuffers
from fsdp2kit.checkpoint.state import extra_to_save, model_options

__all__ = ["Restager", "finish"]


def _key(local: torch.Tensor) -> tuple:
    return (local.data_ptr(), tuple(local.shape), tuple(local.stride()), local.dtype, local.device)


def _structure(model: nn.Module, optimizer, trainable_only: bool) -> tuple:
    """What must not change for the cached mapping to stay valid: which objects hold the state."""
    opt = None
    if optimizer is not None:
        opt = (
            tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups),
            tuple(
                (id(p), tuple((k, id(v) if isinstance(v, torch.Tensor) else type(v)) for k, v in s.items()))
                for p, s in optimizer.state.items()
            ),
        )
    return (
        trainable_only,
        tuple((id(p), p.requires_grad) for p in model.parameters()),
        tuple(id(b) for b in model.buffers()),
        opt,
    )


def _owned(entry: Any) -> Any:
    """An encoded entry whose tensors are copies: the live ones may change after save returns."""
    if isinstance(entry, dict):
        return {k: _owned(v) for k, v in entry.items()}
    if isinstance(entry, torch.Tensor):
        return entry.detach().clone()
    return entry


def _packed(packed: dict) -> dict:
    return _owned(encode(packed, "optimizer state"))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False


class _Unencoded:
    """The optimizer's packed entry (hyper-parameters copied, scalars stacked), encoded later."""

    def __init__(self, packed: dict):
        self.packed = packed


def finish(state: dict) -> dict:
    """The state `Restager.stage` returned, ready for DCP: run in the writer thread."""
    entry = state.get("optimizer", {}).get(PACKED)
    if isinstance(entry, _Unencoded):
        state["optimizer"][PACKED] = _packed(entry.packed)
    return state


class _Mapping:
    """Live tensor -> staging buffer pairs of one state-dict layout, and how to repack the optimizer."""

    def __init__(self) -> None:
        self.structure: tuple = ()
        self.copies: list[tuple[weakref.ref, tuple, torch.Tensor]] = []  # (live, its key, buffer)
        self.scalars: dict[str, tuple[list[weakref.ref], list[tuple], list]] = {}  # dtype -> (live, keys, names)
        self.groups: list[tuple[list[str], list[str]]] = []  # per param group: (key order, FQNs)
        self.staged: dict = {}

    @classmethod
    def build(cls, model, optimizer, trainable_only, state, staged, packed, sources) -> _Mapping | None:
        """The mapping, or None when some saved tensor is not a live tensor's memory (a copy)."""
        live: dict[tuple, torch.Tensor] = {}
        owners = list(model.parameters()) + list(model.buffers())
        if optimizer is not None:
            if packed["values"]:  # non-tensor per-parameter states: read through the full path
                return None
            owners += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for obj in owners:
            live.setdefault(_key(local_shard(obj)), obj)
        m = cls()
        m.structure = _structure(model, optimizer, trainable_only)

        def pair(src: Any, dst: Any) -> bool:
            if isinstance(src, dict):
                return all(pair(v, dst[k]) for k, v in src.items())
            if not isinstance(src, torch.Tensor):
                return False
            local = local_shard(src)
            if local.numel() == 0:
                return True
            obj = live.get(_key(local))
            if obj is None:
                return False
            m.copies.append((weakref.ref(obj), _key(local), local_shard(dst)))
            return True

        if not pair(state["model"], staged["model"]):
            return None
        if optimizer is not None:
            if not pair(state["optimizer"]["state"], staged["optimizer"]["state"]):
                return None
            for dtype, ts in sources.items():
                objs = [live.get(_key(t)) for t in ts]
                if any(o is None for o in objs):
                    return None
                names = packed["scalars"][dtype]["keys"]
                m.scalars[dtype] = ([weakref.ref(o) for o in objs], [_key(t) for t in ts], names)
            saved_groups = packed["param_groups"]
            if len(saved_groups) != len(optimizer.param_groups):
                return None
            for saved, group in zip(saved_groups, optimizer.param_groups):
                if set(saved) != set(group) or any(not _same(saved[k], group[k]) for k in group if k != "params"):
                    return None  # torch's state dict transforms the hyper-parameters: not repacked here
                m.groups.append((list(saved), list(saved["params"])))
        m.staged = staged
        return m

    def copy(self, optimizer) -> dict | None:
        """The staged state with this save's bytes, or None when a live tensor moved."""
        for ref, key, buffer in self.copies:
            obj = ref()
            if obj is None:
                return None
            local = local_shard(obj)
            if _key(local) != key:
                return None
            buffer.copy_(local.detach())
        out: dict[str, Any] = {"model": self.staged["model"]}
        if optimizer is None:
            return out
        scalars = {}
        for dtype, (refs, keys, names) in self.scalars.items():
            values = []
            for ref, key in zip(refs, keys):
                obj = ref()
                if obj is None or _key(local_shard(obj)) != key:
                    return None
                values.append(local_shard(obj).detach().reshape(()))
            scalars[dtype] = {"keys": names, "values": torch.stack(values)}
        groups = [
            {k: (fqns if k == "params" else copy.deepcopy(group[k])) for k in order}
            for (order, fqns), group in zip(self.groups, optimizer.param_groups)
        ]
        packed = {"format": FORMAT, "param_groups": groups, "scalars": scalars, "values": {}}
        # JSON-encoded by `finish`, in the writer thread: everything in it is a copy already
        out["optimizer"] = {"state": self.staged["optimizer"]["state"], PACKED: _Unencoded(packed)}
        return out


class Restager:
    """Stages an asynchronous save's state into CPU buffers reused from save to save (see the module)."""

    def __init__(self, pin_memory: bool = False):
        self._buffers = StagingBuffers(pin_memory=pin_memory)
        self._mapping: _Mapping | None = None
        self.fast_saves = 0
        """How many saves took the copy-only path (for tests and benchmarks)."""

    @torch.no_grad()
    def stage(self, model: nn.Module, optimizer, extra: dict | None, *, rank: int, rng: bool, trainable_only: bool):
        """The state dict DCP writes once `finish` has run, every tensor in it a copy taken now."""
        extra_state = _owned(extra_to_save(extra, rank=rank, rng=rng))  # a bad value raises before any copy
        m = self._mapping
        if m is not None and m.structure == _structure(model, optimizer, trainable_only):
            out = m.copy(optimizer)
            if out is not None:
                self.fast_saves += 1
                out["extra"] = extra_state
                return out
        self._mapping = None
        state: dict[str, Any] = {"model": get_model_state_dict(model, options=model_options(trainable_only))}
        packed, sources = None, None
        if optimizer is not None:
            ostate, packed, sources = optimizer_parts(model, optimizer)
            state["optimizer"] = {"state": ostate}
        staged = self._buffers.stage(state)
        self._mapping = _Mapping.build(model, optimizer, trainable_only, state, staged, packed, sources)
        out = {"model": staged["model"]}
        if optimizer is not None:
            out["optimizer"] = {"state": staged["optimizer"]["state"], PACKED: _packed(packed)}
        out["extra"] = extra_state
        return out

    def close(self) -> None:
        self._mapping = None
        self._buffers.close()
