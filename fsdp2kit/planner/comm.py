"""The collectives FSDP2 issues per unit and per optimizer step, predicted from shapes alone: byte for byte what
`fsdp2kit.count_collectives` measures (what each carries, in which dtype, and how bytes are counted:
docs/accumulation.md, "Predicting them")."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp2kit.accumulation import ACCUMULATION as _POLICIES
from fsdp2kit.accumulation import check_accumulation
from fsdp2kit.plan import ShardPlan
from fsdp2kit.planner.parts import _gathered_bytes, _is_lookup, _padded, compute_dtype, unit_params
from fsdp2kit.replicated import check_replicable
from fsdp2kit.weights.nf4 import NF4_ROW_TENSORS, is_nf4

__all__ = ["ACCUMULATION", "Collective", "CommPlan", "UnitComm", "comm_of_plan", "comm_of_settings", "plan_comm"]

# Gradient accumulation policies, as fsdp2kit.accumulate applies them (fsdp2kit/accumulation.py).
ACCUMULATION = tuple(_POLICIES)


@dataclass(frozen=True)
class Collective:
    """One kind of call a unit makes: ``count`` calls per optimizer step of ``nbytes`` each."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    group: str  # the mesh dimension it runs over: "shard", "replicate"; "shard/K" for a reshard-to-K gather
    nbytes: int  # one call's bytes: its whole buffer (docs/accumulation.md)
    dtype: str  # torch's dtype name ("bfloat16"); "uint8" when parameters of several dtypes travel together
    count: int  # calls per optimizer step
    phase: str  # "forward" | "backward"

    @property
    def total(self) -> int:
        return self.nbytes * self.count


@dataclass(frozen=True)
class UnitComm:
    """One FSDP unit's collectives per optimizer step (an empty tuple when it sends nothing)."""

    name: str
    collectives: tuple[Collective, ...]


@dataclass
class CommPlan:
    """Every FSDP collective of one optimizer step of ``micro_batches`` micro-batches under ``accumulation``;
    ``units`` follow `ShardPlan.units`; ``by_group()`` sums their bytes as `fsdp2kit.count_collectives`'s does,
    ``counts()`` their calls."""

    units: list[UnitComm]
    accumulation: str
    micro_batches: int
    group_sizes: dict[str, int] = field(default_factory=dict)  # ranks in each group named by the collectives
    # Bytes per rank the policy holds from one micro-batch to the next that "regather" does not (what:
    # docs/accumulation.md's table); 0 for one micro-batch.
    held_bytes: int = 0

    @property
    def bytes_per_step(self) -> int:
        return sum(c.total for u in self.units for c in u.collectives)

    def by_group(self) -> dict[str, dict[str, int]]:
        return self._summed("total")

    def counts(self) -> dict[str, dict[str, int]]:
        return self._summed("count")

    def _summed(self, field: str) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for u in self.units:
            for c in u.collectives:
                out[c.group][c.kind] += getattr(c, field)
        return {g: dict(k) for g, k in out.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _counts(accumulation: str, m: int) -> tuple[int, int, int, int]:
    """Per step: (forward gathers, backward re-gathers, reduce-scatters, all-reduces), as docs/accumulation.md's
    table says; one micro-batch: ``fk.accumulate`` changes nothing."""
    check_accumulation(accumulation)
    keep = m > 1 and accumulation.startswith("keep_gathered")  # gathered in the first forward only
    no_sync = m > 1 and accumulation.endswith("no_sync")
    defer = m > 1 and accumulation.endswith("defer_all_reduce")
    return (1 if keep else m), (0 if keep else m), (1 if no_sync else m), (1 if no_sync or defer else m)


def comm_of_plan(
    model: nn.Module,
    plan: ShardPlan,
    *,
    micro_batches: int = 1,
    accumulation: str = "regather",
    replicate_adapters: bool = False,
) -> CommPlan:
    """The FSDP collectives of one optimizer step of ``model`` (as it trains, `fsdp2kit.planner.adapt`) sharded as
    ``plan`` says, ``micro_batches`` passes under an `fsdp2kit.accumulate` policy (docs/accumulation.md)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r}: expected a positive int")
    fwd, bwd, n_rs, n_ar = _counts(accumulation, micro_batches)
    names = dict(zip(plan.mesh_dim_names, plan.mesh_shape))
    if plan.strategy == "NO_SHARD":  # every data-parallel rank is a replica; FSDP2 all-reduces over the 1-D mesh
        shard, replicate, ar_group = 1, math.prod(s for n, s in names.items() if n != "tp"), "shard"
    else:
        shard, replicate, ar_group = names.get("shard", 1), names.get("replicate", 1), "replicate"
    if accumulation.endswith("defer_all_reduce") and replicate == 1:
        raise ValueError(f"accumulation={accumulation!r} defers the all-reduce across replicas: it needs HSDP")
    groups = [(g, n) for g, n in (("shard", shard), (ar_group, replicate)) if n > 1]  # NO_SHARD: ar_group "shard"
    group_sizes = dict(groups)

    keep = bwd == 0 and shard > 1  # the gathered parameters are held between micro-batches
    held = 0
    units = []
    kept = {id(p): p for p in check_replicable(model)} if replicate_adapters else {}
    for (unit_names, params), up in zip(unit_params(model, plan), plan.units):
        params = [p for p in params if id(p) not in kept]
        colls: list[Collective] = []
        gathered = sum(_gathered_bytes(p, shard, compute_dtype(p, plan.precision)) for p in params)
        held += gathered if keep else 0
        if shard > 1 and params:
            # the inputs' one dtype, or bytes when they differ (FSDP2's _get_all_gather_input_metadatas)
            dtypes = {compute_dtype(p, plan.precision) for p in params if not is_nf4(p)}
            dtypes |= {getattr(p, a).dtype for p in params if is_nf4(p) for a in NF4_ROW_TENSORS}
            dtype = _dtype_name(dtypes.pop()) if len(dtypes) == 1 else "uint8"
            colls.append(Collective("all_gather", "shard", gathered, dtype, fwd, "forward"))
            reshard = up.reshard_after_forward
            if reshard is not False and bwd and not _is_lookup(model, unit_names):
                group = "shard" if reshard is True else f"shard/{reshard}"
                if reshard is not True:
                    group_sizes[group] = reshard
                colls.append(Collective("all_gather", group, gathered, dtype, bwd, "backward"))
        trainable = [p for p in params if p.requires_grad]
        if trainable:
            # FSDP2 reduces in reduce_dtype, else in the gradients' dtype: the compute dtype (one per unit)
            rdt = plan.precision.policy.reduce_dtype or compute_dtype(trainable[0], plan.precision)
            rs_in = sum(_padded(p.shape, shard) for p in trainable) * rdt.itemsize
            if shard > 1:
                colls.append(Collective("reduce_scatter", "shard", rs_in, _dtype_name(rdt), n_rs, "backward"))
            if replicate > 1:
                colls.append(Collective("all_reduce", ar_group, rs_in // shard, _dtype_name(rdt), n_ar, "backward"))
            if n_rs < micro_batches:  # no_sync: the unreduced gradients are held
                held += sum(p.numel() for p in trainable) * rdt.itemsize
            if n_ar < n_rs:  # a deferred all-reduce: the reduce-scatter's output is held
                held += rs_in // shard
        units.append(UnitComm(up.name, tuple(colls)))
    if kept:  # fsdp2kit/replicated.py: summed over the shard group, then the replicate one, once a step
        by_dtype: dict[torch.dtype, int] = defaultdict(int)
        for p in kept.values():
            by_dtype[plan.precision.master(p)] += p.numel() * plan.precision.master(p).itemsize
        colls = [
            Collective("all_reduce", g, n, _dtype_name(dt), 1, "backward")
            for dt, n in by_dtype.items()
            for g, _ in groups
        ]
        # issued after the root's backward (the callback at its end): counted with the root unit, the last
        units[-1] = UnitComm(units[-1].name, units[-1].collectives + tuple(colls))
    return CommPlan(units, accumulation, micro_batches, group_sizes, held)


def plan_comm(
    model: nn.Module,
    *,
    shard: int,
    replicate: int = 1,
    tp: int = 1,
    strategy: str | None = None,
    reshard_after_forward: bool | int | None = None,
    mixed_precision: str | None = None,
    lora: int | None = None,
    qlora: bool = False,
    lora_targets: str | tuple[str, ...] = "all-linear",
    micro_batches: int = 1,
    accumulation: str = "regather",
    replicate_adapters: bool = False,
) -> CommPlan:
    """Predict every FSDP collective of one optimizer step: `comm_of_plan` of the model as the run trains it (the
    arguments as for `fsdp2kit.plan_memory` / `fsdp2kit.shard_model`; ``model`` is not changed, and may be on the
    meta device). Example and what each collective carries: docs/accumulation.md, "Predicting them"."""
    from fsdp2kit.planner.adapt import trained_model
    from fsdp2kit.planner.api import check_lora
    from fsdp2kit.precision import resolve_precision
    from fsdp2kit.shard import estimate_plan

    check_lora(lora, qlora, lora_targets, tp)
    compute = resolve_precision(mixed_precision).compute_dtype
    model = trained_model(model, lora=lora, qlora=qlora, targets=lora_targets, tp=tp, compute_dtype=compute)
    plan = estimate_plan(
        model,
        shard=shard,
        replicate=replicate,
        strategy=strategy,
        reshard_after_forward=reshard_after_forward,
        mixed_precision=mixed_precision,
    )
    return comm_of_plan(
        model, plan, micro_batches=micro_batches, accumulation=accumulation, replicate_adapters=replicate_adapters
    )


def comm_of_settings(model: nn.Module, s, *, accumulation: str | None = None, cache: dict | None = None) -> CommPlan:
    """`plan_comm` for a planner `fsdp2kit.planner.api.Settings` (``s.grad_accum`` micro-batches a step under
    ``accumulation``, else ``s.accumulation``), sharing ``cache`` with `fsdp2kit.planner.api.plan_settings`."""
    from fsdp2kit.planner.api import trained_plan

    model, plan = trained_plan(model, s, {} if cache is None else cache)
    return comm_of_plan(
        model,
        plan,
        micro_batches=s.grad_accum,
        accumulation=accumulation or s.accumulation,
        replicate_adapters=s.replicate_adapters,
    )
