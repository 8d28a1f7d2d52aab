"""shard_model: FSDP2 on every block, then on the embeddings, then on the root (how and why: docs/internals.md, section
fsdp2kit/shard.py)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdp2kit._internal.markers import BLOCK_ORDER, SHARDED_AS
from fsdp2kit.blocks import BlockSpec, find_blocks
from fsdp2kit.dist import data_parallel_mesh, fsdp_mesh_shape
from fsdp2kit.plan import ShardPlan
from fsdp2kit.precision import cast_masters, resolve_precision, warn_as_built
from fsdp2kit.preflight import check_devices, check_nf4_shards, check_not_sharded, check_optimizers_at_first_forward
from fsdp2kit.replicated import check_replicable, replicate_trainable
from fsdp2kit.units import assign_units, dtype_subunits

__all__ = ["STRATEGIES", "Strategy", "estimate_plan", "resolve_strategy", "shard_model"]


@dataclass(frozen=True)
class Strategy:
    name: str
    mesh_ndim: int  # the mesh the user must pass: 1 (FSDP) or 2 (HSDP)
    reshard_after_forward: bool
    replicate_only: bool = False  # NO_SHARD: every rank holds everything, gradients all-reduced


# FSDP1's sharding strategies, in FSDP2's terms: the mesh shape says whether there is a
# replicate dimension, reshard_after_forward says whether parameters are freed after forward
# (ZeRO-3) or kept until backward (ZeRO-2).
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("FULL_SHARD", 1, True),
        Strategy("SHARD_GRAD_OP", 1, False),
        Strategy("NO_SHARD", 1, False, replicate_only=True),
        Strategy("HYBRID_SHARD", 2, True),
        Strategy("HYBRID_SHARD_ZERO2", 2, False),
    )
}


def resolve_strategy(
    strategy: str | None, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None = None
) -> Strategy:
    """A strategy name (None: FULL_SHARD on a 1-D mesh, HYBRID_SHARD on a 2-D one), checked against the mesh shape."""
    ndim = len(mesh_shape)
    if ndim not in (1, 2):
        raise ValueError(f"shard_model takes a 1-D (shard) or 2-D (replicate, shard) mesh, got a {ndim}-D mesh")
    if strategy is None:
        return STRATEGIES["FULL_SHARD" if ndim == 1 else "HYBRID_SHARD"]
    key = strategy.upper() if isinstance(strategy, str) else strategy
    if key not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {list(STRATEGIES)}")
    resolved = STRATEGIES[key]
    if resolved.mesh_ndim != ndim:
        if resolved.mesh_ndim == 2:
            hint = "make the mesh with make_mesh(shard=..., replicate=...) and replicate > 1"
        else:
            hint = "use HYBRID_SHARD or HYBRID_SHARD_ZERO2 with a 2-D mesh, or make a 1-D mesh"
        raise ValueError(
            f"strategy {resolved.name} needs a {resolved.mesh_ndim}-D mesh but got a {ndim}-D mesh "
            f"of shape {tuple(mesh_shape)} ({mesh_dim_names}); {hint}"
        )
    return resolved


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: BlockSpec = "auto",
    strategy: str | None = None,
    reshard_after_forward: bool | int | None = None,
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    replicate_adapters: bool = False,
) -> ShardPlan:
    """Shard ``model`` in place with FSDP2 over ``mesh`` and return its `ShardPlan`.

    Args:
        model: the model, on the mesh's device, on CPU with ``cpu_offload``, or on the meta
            device (then call `fsdp2kit.materialize` afterwards).
        mesh: from `fsdp2kit.make_mesh`. FSDP shards over its data-parallel dimensions (each rank's slice
            after `fsdp2kit.apply_tensor_parallel`), ``"shard"`` and ``"cp"`` as one ``shard_cp``.
        blocks: which modules become FSDP units, see `fsdp2kit.blocks.find_blocks`.
        strategy: FSDP1's names: ``FULL_SHARD`` (ZeRO-3, the default on a 1-D mesh), ``SHARD_GRAD_OP``
            (ZeRO-2: gathered parameters kept from forward to backward), ``NO_SHARD`` (DDP-like),
            ``HYBRID_SHARD`` (the default on a 2-D mesh) and ``HYBRID_SHARD_ZERO2``.
        reshard_after_forward: overrides the strategy for every unit: ``True`` / ``False``, or an int, the
            group size to reshard to after forward (e.g. GPUs per node). ``None`` keeps the strategy's
            default, under which the last block, where backward starts, does not reshard.
        mixed_precision: ``"bf16"`` / ``"fp16"`` (that compute over fp32 master weights), ``"pure_bf16"``, ``"fp32"``,
            or ``None`` / a ``MixedPrecisionPolicy`` (trained as built): docs/internals.md, fsdp2kit/precision.py.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (the optimizer
            step runs on CPU).
        replicate_adapters: LoRA / QLoRA: keep the trainable parameters whole on every rank (left out of
            ``fully_shard``), their gradients averaged over the data-parallel ranks once a step; the frozen
            base stays sharded (docs/accumulation.md).

    Build the optimizer after this call: it must see the sharded DTensor parameters (an
    optimizer built before is found at the model's first forward and raises on its first step).
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh (see fsdp2kit.make_mesh), got {type(mesh).__name__}")
    check_not_sharded(model, mesh)
    dp_mesh = data_parallel_mesh(mesh)  # with a tp dimension, FSDP shards over the others only
    # With a cp dimension, FSDP shards over shard x cp together: the layout sees them as one dim.
    shape, names = fsdp_mesh_shape(tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()))
    options = (blocks, strategy, reshard_after_forward, mixed_precision, cpu_offload, replicate_adapters)
    plan, found, units, lookups, kept_ids = _layout(model, shape, names, None, *options)
    check_devices(model, mesh, cpu_offload=cpu_offload)

    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    fsdp_mesh = dp_mesh
    if STRATEGIES[plan.strategy].replicate_only:  # NO_SHARD as FSDP2 spells it: HSDP of one-rank shard groups
        fsdp_mesh = DeviceMesh(dp_mesh.device_type, dp_mesh.mesh.reshape(-1, 1), mesh_dim_names=("replicate", "shard"))
    kept = {n: p for n, p in model.named_parameters() if id(p) in kept_ids}
    replaced = {n: p for n, p in model.named_parameters() if n not in kept}
    for name, p in replaced.items():  # fully_shard replaces them: an optimizer that holds one is refused
        setattr(p, SHARDED_AS, name)
    for _, modules, reshard in units:
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=fsdp_mesh,
            reshard_after_forward=reshard,
            mp_policy=plan.precision.policy,
            offload_policy=offload,
            ignored_params=set(kept.values()) or None,
        )
    warn_as_built(plan.precision, model.parameters())
    cast_masters(model, plan.precision)  # before any mark: it swaps parameter contents
    if kept:
        replicate_trainable(model, [p for n, p in model.named_parameters() if n in kept], dp_mesh)
    for table in lookups:
        # backward of a lookup scatters the output gradient by index: the table is not read
        table.set_unshard_in_backward(False)

    check_optimizers_at_first_forward(model, replaced.values())
    setattr(model, BLOCK_ORDER, found)  # the forward order, for set_prefetch
    return plan


def estimate_plan(
    model: nn.Module,
    *,
    shard: int,
    replicate: int = 1,
    tp: int = 1,
    blocks: BlockSpec = "auto",
    strategy: str | None = None,
    reshard_after_forward: bool | int | None = None,
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    replicate_adapters: bool = False,
) -> ShardPlan:
    """The `ShardPlan` that `shard_model` would return on a (replicate, shard[, tp]) mesh, without a process
    group and changing nothing (a meta model planned for 1024 GPUs from a laptop); with ``tp > 1`` each
    rank's slices follow the model's own TP plan, as `fsdp2kit.apply_tensor_parallel` would apply it."""
    check_not_sharded(model)
    shape, names = ((shard,), ("shard",)) if replicate == 1 else ((replicate, shard), ("replicate", "shard"))
    tp_shapes = None
    if tp > 1:
        from fsdp2kit.parallel.tensor_parallel import planned_tp_shapes

        shape, names = (*shape, tp), (*names, "tp")
        tp_shapes = planned_tp_shapes(model, tp)
    options = (blocks, strategy, reshard_after_forward, mixed_precision, cpu_offload, replicate_adapters)
    return _layout(model, shape, names, tp_shapes, *options)[0]


def _layout(
    model: nn.Module,
    mesh_shape: tuple[int, ...],
    mesh_dim_names: tuple[str, ...],
    tp_shapes: dict[int, tuple[int, ...]] | None,
    blocks: BlockSpec = "auto",
    strategy: str | None = None,
    reshard_after_forward: bool | int | None = None,
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    replicate_adapters: bool = False,
) -> tuple[ShardPlan, list[nn.Module], list[tuple[str, list[nn.Module], bool | int]], list[nn.Embedding], set[int]]:
    """Everything shard_model decides before it touches the model: the plan, the blocks, the units (label, modules,
    reshard_after_forward), the plain nn.Embedding units and the ids of the parameters kept whole."""
    dims = dict(zip(mesh_dim_names, mesh_shape))
    tp = dims.pop("tp", 1)
    resolved = resolve_strategy(strategy, tuple(dims.values()), tuple(dims))
    if tp > 1 and resolved.replicate_only:
        raise ValueError(
            "strategy NO_SHARD with tensor parallelism is not supported: use FULL_SHARD (or HYBRID_SHARD) over the "
            "data-parallel dimensions"
        )
    found = find_blocks(model, blocks)  # children only: the root is never one of its own blocks
    groups, unit_of = assign_units(model, found)
    kept = {id(p) for p in check_replicable(model, cpu_offload)} if replicate_adapters else set()

    precision = resolve_precision(mixed_precision)
    if resolved.replicate_only:
        mesh_shape, mesh_dim_names = (math.prod(mesh_shape), 1), ("replicate", "shard")
    shard_size = 1 if resolved.replicate_only else list(dims.values())[-1]
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        if not isinstance(reshard_after_forward, int):
            raise TypeError(f"reshard_after_forward must be None, a bool or an int, got {reshard_after_forward!r}")
        divisors = [d for d in range(2, shard_size) if shard_size % d == 0]
        if reshard_after_forward not in divisors:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward}: an int is the group size to reshard to after forward "
                f"and must divide the shard size {shard_size} without being 1 or {shard_size}; valid here: "
                f"{divisors or 'none'}"
            )
    check_nf4_shards(dict(model.named_parameters()), shard_size)
    split = {}  # one master dtype for every trainable parameter needs no dtype sub-units
    if precision.master_dtype is None:
        by_unit: dict[str, dict[str, nn.Parameter]] = defaultdict(dict)
        for name, p in model.named_parameters():
            by_unit[unit_of[id(p)]][name] = p
        split = {unit: dtype_subunits(model, unit, params, unit_of) for unit, params in by_unit.items()}

    names = {id(m): n for n, m in model.named_modules()}
    default = resolved.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
    last = found[-1] if reshard_after_forward is None else None  # the strategy's default keeps it gathered
    units = []  # in the order FSDP2 needs them (children first)
    for label, modules, reshard in [
        *((names[id(b)], [b], False if b is last else default) for b in found),
        *((" + ".join(names[id(m)] for m in g), g, default) for g in groups),
        (f"(root) {type(model).__name__}", [model], False if reshard_after_forward is None else default),
    ]:
        # A unit's trainable parameters of a minority dtype are sharded first, as their own unit.
        subunits = split.get("+".join(names[id(m)] for m in modules), [])  # the root's name is ""
        units += [(f"{label} {tag}", mods, reshard) for tag, mods in subunits] + [(label, modules, reshard)]

    plan = ShardPlan(resolved.name, tuple(mesh_shape), tuple(mesh_dim_names), precision.name, cpu_offload)
    plan.precision = precision
    seen: set[int] = set()  # a tied parameter belongs to the first unit that holds it
    for label, modules, reshard in units:
        params = [p for m in modules for p in m.parameters() if id(p) not in seen and not seen.add(id(p))]
        plan.add_unit(label, params, shard_size, reshard, tp_shapes, tuple(names[id(m)] for m in modules), kept)
    lookups = [g[0] for g in groups if len(g) == 1 and type(g[0]) is nn.Embedding]
    return plan, found, units, lookups, kept
