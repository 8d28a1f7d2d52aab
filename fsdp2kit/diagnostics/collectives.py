"""count_collectives: the collectives a block of code issues on this rank, with bytes (docs/accumulation.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp2kit._internal.fmt import fmt_bytes

__all__ = ["CollectiveCounts", "CollectiveEvent", "count_collectives"]

# A collective's kind from its op's name ("_allgather_base_": all_gather); its whole buffer (`count_collectives`
# says which) is a functional collective's input (an all-gather's times group_size), a c10d op's first argument
# (an all-gather's or a scatter's output, the tensors of the others), or its second for these kinds (the input).
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce", "gather", "scatter")
_C10D_INPUT = ("reduce_scatter", "all_to_all", "gather")
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _kind(op_name: str) -> str | None:
    name = op_name.lstrip("_").replace("allgather", "all_gather").replace("allreduce", "all_reduce")
    return next((k for k in _KINDS if name.replace("alltoall", "all_to_all").startswith(k)), None)


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective call on this rank."""

    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast (or reduce, gather, scatter)
    group: str  # the mesh dimension's name, else the process group's description ("world": the default group)
    group_size: int
    nbytes: int  # the whole buffer, as `count_collectives` says
    dtype: str  # torch's dtype name ("bfloat16"; "a+b" when a coalesced call mixes dtypes)


@dataclass
class CollectiveCounts:
    """What `count_collectives` saw, in call order (``events``), with sums by group and kind."""

    events: list[CollectiveEvent] = field(default_factory=list)

    def by_group(self) -> dict[str, dict[str, int]]:
        """``{group: {kind: bytes}}``."""
        return {g: {k: row["bytes"] for k, row in kinds.items()} for g, kinds in self.summary().items()}

    def summary(self) -> dict[str, dict[str, dict]]:
        """``{group: {kind: {"count", "bytes", "dtypes", "ranks"}}}``, JSON-ready (what the recipe logs)."""
        out: dict[str, dict[str, dict]] = {}
        for e in self.events:
            row = out.setdefault(e.group, {}).setdefault(
                e.kind, {"count": 0, "bytes": 0, "dtypes": [], "ranks": e.group_size}
            )
            row["count"] += 1
            row["bytes"] += e.nbytes
            if e.dtype not in row["dtypes"]:
                row["dtypes"].append(e.dtype)
        return out

    def __str__(self) -> str:
        parts = [
            f"{group} {kind} {row['count']}x {fmt_bytes(row['bytes'])} {'/'.join(row['dtypes'])}"
            for group, kinds in self.summary().items()
            for kind, row in kinds.items()
        ]
        return "; ".join(parts) or "no collectives"


class _Counter(TorchDispatchMode):
    def __init__(self, counts: CollectiveCounts, names: dict[str, str]):
        super().__init__()
        self.counts = counts
        self.names = names  # process group name -> mesh dimension name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # let DTensor turn the op into collectives on its local tensors, which come back here
            return NotImplemented
        op = isinstance(func, torch._ops.OpOverload) and func.namespace in _NAMESPACES
        if op and (kind := _kind(func._schema.name.partition("::")[2])) is not None:
            buffer = func._schema.arguments[int(func.namespace == "c10d" and kind in _C10D_INPUT)].name
            bound = {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs}
            group = bound.get("process_group", bound.get("group_name"))  # c10d's boxed group, or a functional's name
            group = _resolve_process_group(group) if isinstance(group, str) else dist.ProcessGroup.unbox(group)
            tensors = [t for t in tree_leaves(bound[buffer]) if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if func.namespace != "c10d" and kind == "all_gather":
                nbytes *= bound["group_size"]
            desc = group.group_desc.removeprefix("mesh_")
            name = self.names.get(group.group_name) or ("world" if desc == "default_pg" else desc)
            dtypes = "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors}))
            self.counts.events.append(CollectiveEvent(kind, name, group.size(), nbytes, dtypes))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_collectives(mesh: DeviceMesh | None = None) -> Iterator[CollectiveCounts]:
    """Count the collectives this rank issues inside the block: kind, process group, bytes, dtype.

    ``with fk.count_collectives(mesh) as counts: <one training step>``, then ``counts.summary()``,
    ``counts.by_group()``, ``counts.events`` or ``print(counts)``. Send/recv and barriers are left out.
    Bytes are each call's whole buffer, the same on every rank of its group (docs/accumulation.md says
    which; ``fsdp2kit.plan_comm`` predicts the FSDP ones). Groups are named by ``mesh``'s dimension names,
    else by the group's description (``"world"``: the default group). Every op inside pays a Python call:
    count a step, not a run.
    """
    counts, names = CollectiveCounts(), {}
    if mesh is not None:
        dims = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        names = {mesh.get_group(i).group_name: n for i, n in enumerate(dims)}
    with _Counter(counts, names):
        yield counts
