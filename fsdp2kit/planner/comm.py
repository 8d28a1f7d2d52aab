"""The collectives FSDP2 issues per unit and per optimizer step, predicted from shapes alone.

The figures are the ones `fsdp2kit.count_collectives` measures on a running model, byte for
byte, so a step-time model can price them before any GPU is rented.

Bytes, everywhere in fsdp2kit: the size of the collective's whole buffer, the "size" of
nccl-tests: an all-gather's output, a reduce-scatter's input, an all-reduce's (or a
broadcast's) tensor, an all-to-all's input. That is the same number on every rank of the group.
What one rank puts on the wire follows from it: ``(n - 1) / n`` of it for a ring all-gather or
reduce-scatter over ``n`` ranks, ``2 (n - 1) / n`` of it for a ring all-reduce.

What FSDP2 issues (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), per unit:

- all-gather over the shard group: every parameter's shard, dim 0 padded to a multiple of the
  shard size, in the compute dtype (``param_dtype``); frozen parameters at their storage dtype,
  an NF4 weight as its packed codes and scalers. Parameters of several dtypes travel as bytes
  (``uint8``). Once per forward, and again in backward when the unit reshards after forward
  (over the smaller group for an int ``reshard_after_forward``: the same bytes), except a plain
  ``nn.Embedding`` unit, which `shard_model` does not gather in backward. None with one rank a
  shard group (``NO_SHARD``).
- reduce-scatter over the shard group: the trainable parameters' gradients, padded alike, in
  ``reduce_dtype`` (the gradients' dtype when it is None). None for a unit with nothing
  trainable, or one rank a shard group.
- all-reduce over the replicate group (HSDP, and ``NO_SHARD``): the reduce-scatter's output,
  ``1 / shard`` of its input, in ``reduce_dtype``.

Not predicted: tensor parallelism's own collectives (activations' all-reduces and
all-gathers over the ``tp`` group, which depend on the batch; the FSDP collectives over the
data-parallel groups are predicted, for each TP rank's slices), `fsdp2kit.clip_grad_norm_`'s
one scalar all-reduce per mesh, and whatever the user's loop reduces (a logged loss).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp2kit.accumulation import ACCUMULATION as _POLICIES
from fsdp2kit.plan import ShardPlan
from fsdp2kit.planner.parts import _gathered_bytes, _is_lookup, _padded, unit_params
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
    nbytes: int  # one call's bytes (the module docstring says which buffer)
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

    @property
    def bytes_per_step(self) -> int:
        return sum(c.total for c in self.collectives)


@dataclass
class CommPlan:
    """Every FSDP collective of one optimizer step of ``micro_batches`` micro-batches under ``accumulation``.

    ``units`` follow `ShardPlan.units` (children first). ``by_group()`` sums them as
    ``{group: {kind: bytes}}`` and ``counts()`` as ``{group: {kind: calls}}``: the shape of
    `fsdp2kit.count_collectives`'s ``by_group()`` / ``counts()``.
    """

    units: list[UnitComm]
    accumulation: str
    micro_batches: int
    group_sizes: dict[str, int] = field(default_factory=dict)  # ranks in each group named by the collectives
    # Bytes per rank the policy holds from one micro-batch to the next that "regather" does not: unsharded
    # parameters (keep_gathered), unsharded gradients in the reduce dtype (no_sync: FSDP2 accumulates them
    # there), each unit's sharded partial sum in the reduce dtype (defer_all_reduce). 0 for one micro-batch.
    held_bytes: int = 0

    @property
    def bytes_per_step(self) -> int:
        return sum(u.bytes_per_step for u in self.units)

    def by_group(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for u in self.units:
            for c in u.collectives:
                out[c.group][c.kind] += c.total
        return {g: dict(k) for g, k in out.items()}

    def counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for u in self.units:
            for c in u.collectives:
                out[c.group][c.kind] += c.count
        return {g: dict(k) for g, k in out.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _compute_dtype(p: torch.Tensor, plan: ShardPlan) -> torch.dtype:
    """What ``p`` is all-gathered and computed in: the policy's ``param_dtype`` if floating, else its master dtype."""
    return (plan.precision.policy.param_dtype if p.is_floating_point() else None) or plan.precision.master(p)


def _gather_dtype(params: list[nn.Parameter], plan: ShardPlan) -> str:
    """FSDP2's all-gather dtype: the inputs' one dtype, or bytes when they differ (_get_all_gather_input_metadatas)."""
    dtypes = set()
    for p in params:
        if is_nf4(p):
            dtypes.update(getattr(p, a).dtype for a in NF4_ROW_TENSORS)
        else:
            dtypes.add(_compute_dtype(p, plan))
    return _dtype_name(dtypes.pop()) if len(dtypes) == 1 else "uint8"


def _counts(accumulation: str, m: int) -> tuple[int, int, int, int]:
    """Per step: (forward gathers, backward re-gathers, reduce-scatters, all-reduces), each a multiple of one."""
    if accumulation == "regather" or (m == 1 and accumulation in ACCUMULATION):
        return m, m, m, m  # one micro-batch: fk.accumulate changes nothing
    if accumulation == "keep_gathered":  # gathered in the first forward, resharded after the last backward
        return 1, 0, m, m
    if accumulation == "defer_all_reduce":
        return m, m, m, 1
    if accumulation == "no_sync":
        return m, m, 1, 1
    if accumulation == "keep_gathered_defer_all_reduce":
        return 1, 0, m, 1
    if accumulation == "keep_gathered_no_sync":
        return 1, 0, 1, 1
    raise ValueError(f"accumulation={accumulation!r}: expected one of {list(ACCUMULATION)}")


def comm_of_plan(
    model: nn.Module,
    plan: ShardPlan,
    *,
    micro_batches: int = 1,
    accumulation: str = "regather",
    replicate_adapters: bool = False,
) -> CommPlan:
    """The FSDP collectives of one optimizer step of ``model`` sharded as ``plan`` says.

    ``model`` is the model as it trains (a peft model with its adapters; under TP, one TP rank's
    slices, as `fsdp2kit.planner.adapt.tp_local_model` builds it) and ``plan`` its `ShardPlan`
    (`fsdp2kit.estimate_plan` of that model, or what `shard_model` returned for it). Needs no
    process group; nothing is allocated.

    Args:
        micro_batches: forward + backward passes per optimizer step (gradient accumulation).
        accumulation: how those micro-batches communicate (`fsdp2kit.accumulate`):
            ``"regather"`` (FSDP2's default: every micro-batch gathers, re-gathers in backward,
            reduce-scatters and, under HSDP, all-reduces), ``"keep_gathered"`` (gather once,
            keep the unsharded parameters until the last backward; reduce every micro-batch),
            ``"defer_all_reduce"`` (HSDP: reduce-scatter every micro-batch, all-reduce across
            replicas once, on the last), ``"no_sync"`` (gather as ``"regather"``, reduce once,
            on the last micro-batch, holding unsharded gradients until then),
            ``"keep_gathered_defer_all_reduce"`` (HSDP: gather once, all-reduce once),
            ``"keep_gathered_no_sync"`` (gather once, reduce once: the fewest bytes, the most memory).
        replicate_adapters: the trainable parameters are left out of the units, whole on every rank
            (`fsdp2kit.shard_model`'s option): one all-reduce a step per data-parallel group and dtype,
            counted with the root unit (they follow its backward).
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r}: expected a positive int")
    fwd, bwd, n_rs, n_ar = _counts(accumulation, micro_batches)
    names = dict(zip(plan.mesh_dim_names, plan.mesh_shape))
    replicate_only = plan.strategy == "NO_SHARD"
    shard = 1 if replicate_only else names.get("shard", 1)
    replicate = names.get("replicate", 1)
    if replicate_only:
        # NO_SHARD: every data-parallel rank is a replica; FSDP2 all-reduces over the user's (1-D) mesh
        replicate, ar_group = math.prod(s for n, s in names.items() if n != "tp"), "shard"
    else:
        ar_group = "replicate"
    if accumulation in ("defer_all_reduce", "keep_gathered_defer_all_reduce") and replicate == 1:
        raise ValueError(f"accumulation={accumulation!r} defers the all-reduce across replicas: it needs HSDP")
    group_sizes = {"shard": shard} if shard > 1 else {}
    if replicate > 1:
        group_sizes[ar_group] = replicate

    many = micro_batches > 1
    keep = many and shard > 1 and accumulation.startswith("keep_gathered")
    unsynced = many and accumulation in ("no_sync", "keep_gathered_no_sync")
    deferred = many and accumulation in ("defer_all_reduce", "keep_gathered_defer_all_reduce")
    held = 0
    units = []
    kept = {id(p): p for p in check_replicable(model)} if replicate_adapters else {}
    for (unit_names, params), up in zip(unit_params(model, plan), plan.units):
        params = [p for p in params if id(p) not in kept]
        colls: list[Collective] = []
        if keep:
            held += sum(_gathered_bytes(p, shard, _compute_dtype(p, plan)) for p in params)
        if shard > 1 and params:
            gathered = 0
            for p in params:
                gathered += _gathered_bytes(p, shard, _compute_dtype(p, plan))
            dtype = _gather_dtype(params, plan)
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
            rdt = plan.precision.policy.reduce_dtype or _compute_dtype(trainable[0], plan)
            rs_in = sum(_padded(p.shape, shard) for p in trainable) * rdt.itemsize
            if shard > 1:
                colls.append(Collective("reduce_scatter", "shard", rs_in, _dtype_name(rdt), n_rs, "backward"))
            if replicate > 1:
                colls.append(Collective("all_reduce", ar_group, rs_in // shard, _dtype_name(rdt), n_ar, "backward"))
            if unsynced:
                held += sum(p.numel() for p in trainable) * rdt.itemsize
            if deferred:
                held += rs_in // shard
        units.append(UnitComm(up.name, tuple(colls)))
    if kept:  # fsdp2kit/replicated.py: summed over the shard group, then the replicate one, once a step
        by_dtype: dict[torch.dtype, int] = defaultdict(int)
        for p in kept.values():
            by_dtype[plan.precision.master(p)] += p.numel() * plan.precision.master(p).itemsize
        groups = [("shard", shard), ("replicate", replicate)] if not replicate_only else [("shard", replicate)]
        colls = [
            Collective("all_reduce", g, n, _dtype_name(dt), 1, "backward")
            for dt, n in by_dtype.items()
            for g, size in groups
            if size > 1
        ]
        # issued after the root's backward (the callback at its end): counted with the root unit, the last
        units[-1] = UnitComm(units[-1].name, units[-1].collectives + tuple(colls))
        for g, size in groups:
            if size > 1:
                group_sizes[g] = size
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
    """Predict every FSDP collective of one optimizer step: `comm_of_plan` of the model as the run trains it.

    The arguments mean what they mean for `fsdp2kit.plan_memory` / `fsdp2kit.shard_model`
    (``lora``/``qlora``/``lora_targets`` put the recipe's adapters on a copy; ``tp`` plans one
    TP rank's slices); ``micro_batches`` and ``accumulation`` as in `comm_of_plan`. ``model`` is
    not changed (build it on the meta device: nothing is allocated).

    Example: bytes per step by group and kind, for 4 micro-batches on 2 nodes of 8::

        plan_comm(model, shard=8, replicate=2, mixed_precision="bf16", micro_batches=4,
                  accumulation="defer_all_reduce").by_group()
        # {"shard": {"all_gather": ..., "reduce_scatter": ...}, "replicate": {"all_reduce": ...}}
    """
    from fsdp2kit.planner.adapt import lora_model, tp_local_model
    from fsdp2kit.planner.api import check_lora
    from fsdp2kit.precision import resolve_precision
    from fsdp2kit.shard import estimate_plan

    check_lora(lora, qlora, lora_targets, tp)
    if lora is not None:
        compute = resolve_precision(mixed_precision).compute_dtype
        model = lora_model(model, r=lora, qlora=qlora, targets=lora_targets, compute_dtype=compute)
    if tp > 1:
        model = tp_local_model(model, tp)
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
    ``accumulation``, else ``s.accumulation``),
    sharing ``cache`` with `fsdp2kit.planner.api.plan_settings` (the adapted model is built once)."""
    from fsdp2kit.planner.api import _as_trained
    from fsdp2kit.precision import resolve_precision
    from fsdp2kit.shard import estimate_plan

    s.check()
    prec = resolve_precision(s.mixed_precision)
    model = _as_trained(model, s, prec.compute_dtype, {} if cache is None else cache)
    plan = estimate_plan(model, shard=s.shard * s.cp, replicate=s.replicate, strategy=s.strategy, mixed_precision=prec)
    return comm_of_plan(
        model,
        plan,
        micro_batches=s.grad_accum,
        accumulation=accumulation or s.accumulation,
        replicate_adapters=s.replicate_adapters,
    )
