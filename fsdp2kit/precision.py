"""Mixed-precision policies by name.

FSDP2 casts parameters when it all-gathers them, so the compute dtype is chosen per unit at
sharding time, and the sharded fp32 parameters stay the optimizer's master weights.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["MIXED_PRECISION", "resolve_mixed_precision"]

# Gradients are reduced in fp32 in every named policy: averaging N low-precision gradients in
# bf16 loses the low bits exactly where small updates live, and the reduce-scatter costs the
# same bytes either way once communication overlaps compute. fp16 also needs loss scaling
# (torch.amp.GradScaler) because its range is narrow; bf16 does not.
MIXED_PRECISION: dict[str, MixedPrecisionPolicy] = {
    "fp32": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
}


def resolve_mixed_precision(mixed_precision: str | MixedPrecisionPolicy | None) -> MixedPrecisionPolicy:
    """``None`` or ``"fp32"`` (no casting), ``"bf16"``, ``"fp16"``, or a policy, which is passed through."""
    if mixed_precision is None:
        return MIXED_PRECISION["fp32"]
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if isinstance(mixed_precision, str) and mixed_precision.lower() in MIXED_PRECISION:
        return MIXED_PRECISION[mixed_precision.lower()]
    raise ValueError(
        f"mixed_precision={mixed_precision!r}: expected None, one of {sorted(MIXED_PRECISION)} "
        "or a torch.distributed.fsdp.MixedPrecisionPolicy"
    )
