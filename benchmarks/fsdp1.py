"""FSDP1 (``FullyShardedDataParallel``) with shard_model's options, for side-by-side benchmarks.

`wrap_fsdp1` makes the same FSDP units as `shard_model`: every block `find_blocks` returns,
every untied embedding outside the blocks, and the root with what is left. Strategy names,
mixed-precision names and the mesh mean what they mean to `shard_model`, so a benchmark can
hold everything equal except the FSDP implementation.

What cannot be matched, and why:
- FSDP1 flattens each unit's parameters into one ``FlatParameter`` and shards that evenly;
  FSDP2 shards every parameter on dim 0. Bytes per rank agree up to padding.
- FSDP1 wraps the model in a new module (parameter names gain ``_fsdp_wrapped_module.``
  unless ``use_orig_params=True`` and the names are read through FSDP's state-dict API).
- A tied embedding and output head are two modules; an FSDP1 unit is one module, so a tied
  group stays in the root unit (``shard_model`` makes it a unit of its own).
- ``shard_model`` keeps the last block gathered after forward (backward starts with it);
  FSDP1 has no per-unit switch short of wrapping by hand and reshards it. Both keep the root.

The FSDP1-only knobs keep FSDP1's own defaults (``backward_prefetch="BACKWARD_PRE"``,
``forward_prefetch=False``, ``limit_all_gathers=True``, ``use_orig_params=False``), so the
"defaults" comparison is each library as its users get it.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import CustomPolicy

from fsdp2kit.blocks import BlockSpec, find_blocks
from fsdp2kit.dist import mesh_device
from fsdp2kit.precision import resolve_precision
from fsdp2kit.shard import resolve_strategy
from fsdp2kit.units import assign_units

__all__ = ["fsdp1_sharding_strategy", "wrap_fsdp1"]

_SHARDING = {
    "FULL_SHARD": ShardingStrategy.FULL_SHARD,
    "SHARD_GRAD_OP": ShardingStrategy.SHARD_GRAD_OP,
    "NO_SHARD": ShardingStrategy.NO_SHARD,
    "HYBRID_SHARD": ShardingStrategy.HYBRID_SHARD,
    "HYBRID_SHARD_ZERO2": ShardingStrategy._HYBRID_SHARD_ZERO2,
}

_PREFETCH = {
    None: None,
    "BACKWARD_PRE": BackwardPrefetch.BACKWARD_PRE,
    "BACKWARD_POST": BackwardPrefetch.BACKWARD_POST,
}


def fsdp1_sharding_strategy(strategy: str | None, mesh: DeviceMesh) -> ShardingStrategy:
    """shard_model's strategy name (checked against the mesh exactly as shard_model checks it)."""
    resolved = resolve_strategy(strategy, tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()))
    return _SHARDING[resolved.name]


def fsdp1_mixed_precision(mixed_precision) -> MixedPrecision | None:
    policy = resolve_precision(mixed_precision).policy
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return None
    # Buffers keep their dtype, as under FSDP2 (which never casts buffers): RoPE's inv_freq in
    # bf16 would change the model, not just its speed.
    return MixedPrecision(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
    )


def wrap_fsdp1(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: BlockSpec = "auto",
    strategy: str | None = None,
    mixed_precision=None,
    cpu_offload: bool = False,
    backward_prefetch: str | None = "BACKWARD_PRE",
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    use_orig_params: bool = False,
) -> FullyShardedDataParallel:
    """Wrap ``model`` with FSDP1 units matching `shard_model`'s and return the wrapper.

    Args:
        model: the model on the mesh's device (FSDP1 moves nothing: ``device_id`` is the mesh's
            device, which is also what makes FSDP1 run on CPU with gloo).
        mesh: 1-D ``("shard",)`` or, for the HYBRID strategies, 2-D ``("replicate", "shard")``.
        blocks, strategy, mixed_precision, cpu_offload: as for `shard_model`.
        backward_prefetch: ``"BACKWARD_PRE"`` (FSDP1's default: gather the next unit before
            this unit's gradient is computed), ``"BACKWARD_POST"`` or ``None``.
        forward_prefetch: gather the next unit during this unit's forward (FSDP1 default off).
        limit_all_gathers: the rate limiter that keeps at most two gathered units in flight.
        use_orig_params: expose the original parameters instead of flat ones (needed for
            ``torch.compile`` and per-parameter optimizer groups).

    Build the optimizer on the returned module's ``parameters()`` afterwards.
    """
    sharding = fsdp1_sharding_strategy(strategy, mesh)
    found = find_blocks(model, blocks)
    if any(b is model for b in found):
        raise ValueError("the root module cannot be one of its own blocks")
    groups, _ = assign_units(model, found)
    units = {id(m) for m in found} | {id(g[0]) for g in groups if len(g) == 1}
    if backward_prefetch not in _PREFETCH:
        raise ValueError(f"backward_prefetch={backward_prefetch!r}: expected one of {list(_PREFETCH)}")
    device = mesh_device(mesh.device_type)
    return FullyShardedDataParallel(
        model,
        device_mesh=mesh,
        sharding_strategy=sharding,
        auto_wrap_policy=CustomPolicy(lambda m: id(m) in units),
        mixed_precision=fsdp1_mixed_precision(mixed_precision),
        cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None,
        backward_prefetch=_PREFETCH[backward_prefetch],
        forward_prefetch=forward_prefetch,
        limit_all_gathers=limit_all_gathers,
        use_orig_params=use_orig_params,
        device_id=device,
    )
