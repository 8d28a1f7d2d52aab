"""A rank's memory from parameter shapes and dtypes: FSDP units, optimizer state and temporaries, allocator margin."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp2kit.optim import OPTIMIZERS as MAKE_OPTIMIZER_NAMES
from fsdp2kit.optim import state_block, state_bytes
from fsdp2kit.plan import ShardPlan
from fsdp2kit.planner.timeline import Unit
from fsdp2kit.weights.nf4 import NF4_ROW_TENSORS, is_nf4

__all__ = ["OPTIMIZERS", "OptimizerBytes", "margin_bytes", "optimizer_bytes", "rank_shards", "unit_params", "units_for"]

# make_optimizer's names (fsdp2kit/optim.py, whose state_bytes follows torchao's allocation), and sgd.
OPTIMIZERS = (*MAKE_OPTIMIZER_NAMES, "sgd")

# Bytes torchao's compiled step allocates per element of a quantized shard, beyond its two new fp32 scales a
# block (measured: docs/optimizers.md, "Step temporaries").
_STEP_PER_ELEMENT = {"adamw8bit": 8, "adamw4bit": 26, "adamw_fp8": 0}


def _gathered_bytes(p: torch.Tensor, shard: int, compute_dtype: torch.dtype) -> int:
    """Bytes FSDP2 all-gathers for ``p``: dim 0 padded to the shard size, in ``compute_dtype``; an NF4Tensor its
    packed codes and scalers as they are (torchao's ``fsdp_pre_all_gather``), padded alike."""
    if is_nf4(p):
        inner = [getattr(p, a) for a in NF4_ROW_TENSORS]
        return sum(math.ceil(t.numel() / shard) * shard * t.element_size() for t in inner)
    return _padded(p.shape, shard) * compute_dtype.itemsize


def _padded(shape: torch.Size, shard: int) -> int:
    """Elements FSDP2 allocates for an unsharded parameter: dim 0 padded to a multiple of the shard size."""
    if len(shape) == 0:
        return shard
    return math.ceil(shape[0] / shard) * shard * math.prod(shape[1:])


def unit_params(model: nn.Module, plan: ShardPlan) -> list[tuple[list[str], list[nn.Parameter]]]:
    """Each plan unit's module names and the parameters it owns (a tied one in the first unit, as shard_model does)."""
    modules = dict(model.named_modules())
    seen: set[int] = set()
    out = []
    for u in plan.units:
        names = list(u.modules)  # a dtype sub-unit's label lists its modules shortened
        params = {id(p): p for n in names for p in modules[n].parameters() if id(p) not in seen}
        seen.update(params)
        out.append((names, list(params.values())))
    return out


def _is_lookup(model: nn.Module, names: list[str]) -> bool:
    """Whether a unit is one plain ``nn.Embedding`` (not the root), which `shard_model` does not gather in backward;
    ``names`` are `unit_params`' (modules of the model)."""
    return len(names) == 1 and names[0] != "" and type(model.get_submodule(names[0])) is nn.Embedding


def compute_dtype(p: torch.Tensor, precision) -> torch.dtype:
    """What FSDP2 gathers and computes ``p`` in: the policy's ``param_dtype`` if floating, else its master dtype."""
    return (precision.policy.param_dtype if p.is_floating_point() else None) or precision.master(p)


def units_for(model: nn.Module, plan: ShardPlan, *, replicated: set[int] = frozenset()) -> list[Unit]:
    """`Unit` byte counts for every unit of ``plan`` in its precision; a ``replicated`` parameter (by id) is neither
    gathered nor reduced: its whole gradient stays as ``.grad`` (counted as sharded)."""
    shard = plan.mesh_shape[-1]
    precision = plan.precision
    out = []
    for (names, params), up in zip(unit_params(model, plan), plan.units):
        gathered = grads = rs_in = rs_out = sharded = 0
        for p in params:
            if id(p) in replicated:
                sharded += p.numel() * precision.master(p).itemsize
                continue
            cdt = compute_dtype(p, precision)
            padded = _padded(p.shape, shard)
            gathered += _gathered_bytes(p, shard, cdt)
            if p.requires_grad:
                rdt = precision.policy.reduce_dtype or cdt
                grads += p.numel() * cdt.itemsize
                rs_in += padded * rdt.itemsize
                rs_out += padded // shard * rdt.itemsize
                sharded += padded // shard * precision.master(p).itemsize
        out.append(
            Unit(
                name=up.name,
                gathered=gathered,
                unsharded_grads=grads,
                reduce_input=rs_in,
                reduce_output=rs_out,
                sharded_grads=sharded,
                reshard_after_forward=up.reshard_after_forward is not False,
                gather_in_backward=not _is_lookup(model, names),
            )
        )
    return out


@dataclass(frozen=True)
class OptimizerBytes:
    state: int  # persistent, per rank
    temporaries: int  # extra during optimizer.step()


def rank_shards(model: nn.Module, shard: int, precision) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
    """``(numel, master dtype, global shape)`` of each trainable parameter's largest shard (dim 0 split
    over ``shard`` ranks), the input of `optimizer_bytes`."""
    return [
        (_padded(p.shape, shard) // shard, precision.master(p), tuple(p.shape))
        for p in model.parameters()
        if p.requires_grad
    ]


def optimizer_bytes(
    shards: list[tuple[int, torch.dtype, tuple[int, ...]]], optimizer: str, *, implementation: str = "foreach"
) -> OptimizerBytes:
    """State and step temporaries for one rank's sharded trainable parameters (`rank_shards`), as
    docs/memory_planner.md ("How", step 3) counts them; the names are checked where they arrive (`Settings.check`)."""
    if not shards or optimizer == "sgd":
        return OptimizerBytes(0, 0)
    if optimizer == "adamw":
        sizes = [n * dt.itemsize for n, dt, _ in shards]
        loop = max(2 * b + a for a, b in zip([0, *sizes], sizes))
        return OptimizerBytes(2 * sum(sizes), {"foreach": sum(sizes), "for-loop": loop, "fused": 0}[implementation])
    state = sum(state_bytes(n, dt, optimizer, shape) for n, dt, shape in shards)
    blocks = [(n, state_block(optimizer, shape)) for n, _, shape in shards]
    temp = max((_STEP_PER_ELEMENT[optimizer] * n + 8 * (n // b) for n, b in blocks if b), default=0)
    return OptimizerBytes(state, temp)


def margin_bytes(peak: int, device: str) -> int:
    """What a device's allocator holds beyond live tensors at the peak: nothing on CPU (live tensor bytes, what the
    CPU check measures); on CUDA 5% of the peak plus 0.5 GiB (why: docs/memory_planner.md, "The allocator margin")."""
    return 0 if device == "cpu" else int(0.05 * peak) + (1 << 29)
