"""ShardPlan: what each FSDP unit holds per rank, from shapes alone (how and why: docs/internals.md, plan.py)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit._internal.fmt import fmt_bytes, fmt_count
from fsdp2kit.precision import PRECISIONS, Precision, dtype_name
from fsdp2kit.weights.nf4 import NF4_ROW_TENSORS, is_nf4

__all__ = ["ShardPlan", "UnitPlan"]


def _tp_shape(p: torch.Tensor, planned: Mapping[int, torch.Size] | None = None) -> torch.Size:
    """The part of ``p`` one TP rank holds; ``planned`` (by ``id(p)``) gives it for a model TP has not split yet."""
    return planned[id(p)] if planned and id(p) in planned else local_shard(p).shape


def _sharded_bytes(
    p: torch.Tensor, shard: int, tp_shapes: Mapping[int, torch.Size] | None = None, dtype: torch.dtype | None = None
) -> int:
    """Bytes of the largest shard of ``p`` in ``dtype`` (default its own); NF4: the inner tensors it stores."""
    if is_nf4(p):  # the packed data and both scaler levels are split by rows; the mean and the 16-entry table copied
        inner = {a: getattr(p, a) for a in p.__tensor_flatten__()[0]}
        return sum(
            math.ceil(t.numel() / (shard if a in NF4_ROW_TENSORS else 1)) * t.element_size() for a, t in inner.items()
        )
    shape = _tp_shape(p, tp_shapes)
    numel = math.ceil(shape[0] / shard) * math.prod(shape[1:]) if len(shape) else 1
    return numel * (dtype or p.dtype).itemsize


def _gathered_bytes(p: torch.Tensor, precision: Precision, tp_shapes: Mapping[int, torch.Size] | None) -> int:
    """Bytes of ``p`` all-gathered for compute: an NF4 weight travels and stays packed (each Linear
    dequantizes it in its own forward), anything floating is cast to the policy's compute dtype."""
    if is_nf4(p):
        return _sharded_bytes(p, 1)
    cast = precision.policy.param_dtype if p.is_floating_point() else None
    return math.prod(_tp_shape(p, tp_shapes)) * (cast or precision.master(p)).itemsize


@dataclass(frozen=True)
class UnitPlan:
    name: str
    n_params: int
    bytes_per_rank: int  # sharded parameters, trainable ones in their master dtype
    bytes_gathered: int  # unsharded parameters while the unit runs, in the compute dtype
    trainable_bytes_per_rank: int
    reshard_after_forward: bool | int
    modules: tuple[str, ...] = ()  # the fully_shard'ed modules' names ("" for the root)


@dataclass
class ShardPlan:
    """Returned by `shard_model`; ``print(plan)`` shows one row per FSDP unit and per-rank totals."""

    strategy: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    mixed_precision: str
    cpu_offload: bool
    units: list[UnitPlan] = field(default_factory=list)
    precision: Precision = PRECISIONS["fp32"]
    master_numel: dict[str, int] = field(default_factory=dict)  # trainable elements by master dtype name
    cast_numel: dict[str, int] = field(default_factory=dict)  # of those, cast at sharding, by dtype as built
    replicated_numel: int = 0  # trainable elements kept whole on every rank (replicate_adapters)

    def add_unit(
        self,
        name: str,
        params: list[torch.nn.Parameter],
        shard: int,
        reshard_after_forward: bool | int,
        tp_shapes: Mapping[int, torch.Size] | None = None,
        modules: tuple[str, ...] = (),
        replicated: Collection[int] = (),
    ) -> None:
        """Append the unit that holds ``params`` (those in ``replicated``, by id, whole and never gathered), and
        count its trainable parameters by master dtype (and those that sharding casts, by their dtype as built)."""
        prec = self.precision
        sharded = [_sharded_bytes(p, 1 if id(p) in replicated else shard, tp_shapes, prec.master(p)) for p in params]
        gathered = sum(_gathered_bytes(p, prec, tp_shapes) for p in params if id(p) not in replicated)
        self.replicated_numel += sum(p.numel() for p in params if id(p) in replicated)
        trainable = sum(b for b, p in zip(sharded, params) if p.requires_grad)
        n = sum(p.numel() for p in params)
        self.units.append(UnitPlan(name, n, sum(sharded), gathered, trainable, reshard_after_forward, modules))
        for p in params:
            if p.requires_grad:
                master = prec.master(p)
                self.master_numel[dtype_name(master)] = self.master_numel.get(dtype_name(master), 0) + p.numel()
                if master != p.dtype:
                    self.cast_numel[dtype_name(p.dtype)] = self.cast_numel.get(dtype_name(p.dtype), 0) + p.numel()

    @property
    def master_dtype(self) -> str:
        """The trainable parameters' master dtype (``"fp32"``, ``"bf16"``; several as ``"fp32 + bf16"``,
        most elements first; ``"none"`` with nothing trainable)."""
        order = sorted(self.master_numel, key=lambda d: -self.master_numel[d])
        return " + ".join(order) or "none"

    @property
    def state_dtype(self) -> str:
        """AdamW's state dtype: ``torch.optim.AdamW`` keeps exp_avg and exp_avg_sq like each parameter."""
        return self.master_dtype

    @property
    def precision_line(self) -> str:
        """Which dtype the master weights, gradients, AdamW state, compute and gradient reduction use."""
        prec, masters = self.precision, self.master_dtype
        cast = f" (cast from {' + '.join(sorted(self.cast_numel))} at sharding)" if self.cast_numel else ""
        line = f"master weights {masters}{cast}, gradients {masters}, AdamW state {self.state_dtype}; compute "
        line += dtype_name(prec.compute_dtype) if prec.compute_dtype else "in each parameter's dtype"
        reduce = prec.policy.reduce_dtype or prec.compute_dtype
        line += f", gradient reduction {dtype_name(reduce)}" if reduce else ""
        low = [d for d in self.master_numel if d in ("bf16", "fp16")]
        if prec.name == "pure_bf16":
            line += "; bf16 masters chosen (pure_bf16): an update below half a bf16 step rounds away"
        elif low and prec.master_dtype is None:
            line += f"; {' + '.join(low)} masters as built: mixed_precision='bf16' would keep fp32 masters"
        return line

    @property
    def n_params(self) -> int:
        return sum(u.n_params for u in self.units)

    @property
    def param_bytes_per_rank(self) -> int:
        return sum(u.bytes_per_rank for u in self.units)

    @property
    def grad_bytes_per_rank(self) -> int:
        # Reduced gradients land in the sharded parameters' dtype (fp32 master weights stay fp32).
        return sum(u.trainable_bytes_per_rank for u in self.units)

    @property
    def adam_bytes_per_rank(self) -> int:
        # exp_avg and exp_avg_sq, each shaped and typed like the sharded parameter.
        return 2 * self.grad_bytes_per_rank

    @property
    def state_bytes_per_rank(self) -> int:
        """Parameters + gradients + Adam state per rank: the floor that activations come on top of."""
        return self.param_bytes_per_rank + self.grad_bytes_per_rank + self.adam_bytes_per_rank

    def __str__(self) -> str:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        head = (
            f"ShardPlan: {len(self.units)} FSDP units over mesh ({mesh}), strategy {self.strategy}, "
            f"precision {self.mixed_precision}" + (", CPU offload" if self.cpu_offload else "")
        )
        if self.replicated_numel:
            head += f", {fmt_count(self.replicated_numel)} trainable parameters replicated (whole on every rank)"

        rows = [("unit", "params", "per rank", "gathered", "reshard")]
        for u in self.units:
            reshard = {True: "yes", False: "no"}.get(u.reshard_after_forward, f"to {u.reshard_after_forward}")
            rows.append(
                (u.name, fmt_count(u.n_params), fmt_bytes(u.bytes_per_rank), fmt_bytes(u.bytes_gathered), reshard)
            )
        rows.append(("total", fmt_count(self.n_params), fmt_bytes(self.param_bytes_per_rank), "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        rows.insert(-1, tuple("-" * w for w in widths))
        lines = [head, self.precision_line]
        lines += [
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows
        ]
        lines.append(
            f"per rank: parameters {fmt_bytes(self.param_bytes_per_rank)}, "
            f"gradients {fmt_bytes(self.grad_bytes_per_rank)}, "
            f"Adam state {fmt_bytes(self.adam_bytes_per_rank)} (sum {fmt_bytes(self.state_bytes_per_rank)}); "
            f"largest all-gather {fmt_bytes(max((u.bytes_gathered for u in self.units), default=0))}"
        )
        return "\n".join(lines)
