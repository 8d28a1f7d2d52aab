"""Mixed-precision policies by name, and the master weights' dtype (docs/internals.md, fsdp2kit/precision.py)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["PRECISIONS", "Precision", "cast_masters", "dtype_name", "resolve_precision", "warn_as_built"]


@dataclass(frozen=True)
class Precision:
    """A named choice: FSDP2's policy (compute and reduce dtypes) and the master weights' dtype."""

    name: str
    policy: MixedPrecisionPolicy
    master_dtype: torch.dtype | None  # trainable floating-point parameters are kept in it; None: as built

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype forward and backward run in (None: each parameter's own)."""
        return self.policy.param_dtype or self.master_dtype

    def master(self, p: torch.Tensor) -> torch.dtype:
        """The dtype ``p`` is sharded, stepped and checkpointed in."""
        as_built = self.master_dtype is None or not p.requires_grad or not p.is_floating_point()
        return p.dtype if as_built else self.master_dtype


# Gradients are reduced in fp32 in every named policy, pure_bf16 too: averaging in bf16 loses the low bits where
# small updates live, and the reduce-scatter overlaps compute either way.
_BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
_FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", MixedPrecisionPolicy(), torch.float32),
    "bf16": Precision("bf16", _BF16, torch.float32),
    "fp16": Precision("fp16", _FP16, torch.float32),
    "pure_bf16": Precision("pure_bf16", _BF16, torch.bfloat16),
}
_AS_BUILT = Precision("as built", MixedPrecisionPolicy(), None)


def resolve_precision(mixed_precision: str | MixedPrecisionPolicy | Precision | None) -> Precision:
    """``None`` (as built), a name of `PRECISIONS`, or a ``MixedPrecisionPolicy`` (as built, that policy)."""
    if mixed_precision is None:
        return _AS_BUILT
    if isinstance(mixed_precision, Precision):
        return mixed_precision
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return Precision("custom", mixed_precision, None)
    if isinstance(mixed_precision, str) and mixed_precision.lower() in PRECISIONS:
        return PRECISIONS[mixed_precision.lower()]
    raise ValueError(
        f"mixed_precision={mixed_precision!r}: expected None, one of {sorted(PRECISIONS)} "
        "or a torch.distributed.fsdp.MixedPrecisionPolicy"
    )


def dtype_name(dtype: torch.dtype) -> str:
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return short.get(dtype, str(dtype).removeprefix("torch."))


def cast_masters(model: nn.Module, precision: Precision) -> None:
    """Cast the trainable floating-point parameters of a sharded model to the master dtype, each rank its own shard,
    through ``Module._apply``, whose FSDP2 override re-registers each shard (as ``model.to(dtype)`` would)."""
    todo = {id(p) for p in model.parameters() if precision.master(p) != p.dtype}
    if todo:  # only when master_dtype is set: precision.master(p) is p.dtype otherwise
        model._apply(lambda t: t.to(precision.master_dtype) if id(t) in todo else t)


def warn_as_built(precision: Precision, params: Iterable[torch.Tensor]) -> None:
    """Say so when a policy that trains parameters as built leaves trainable ones in 16 bits."""
    low = [p for p in params if p.requires_grad and p.is_floating_point() and p.element_size() < 4]
    if precision.master_dtype is not None or not low:
        return
    which = ", ".join(sorted({dtype_name(p.dtype) for p in low}))
    warnings.warn(
        f"shard_model(mixed_precision={'None' if precision is _AS_BUILT else 'a MixedPrecisionPolicy'}) trains the "
        f"parameters as built: {sum(p.numel() for p in low)} trainable elements are {which}, so their master weights, "
        "gradients and AdamW state are too, and updates smaller than half a step of that dtype round away. "
        "Pass mixed_precision='bf16' (or 'fp16') for fp32 master weights with 16-bit compute, or "
        "mixed_precision='pure_bf16' to train in bf16 on purpose.",
        UserWarning,
        stacklevel=3,
    )
