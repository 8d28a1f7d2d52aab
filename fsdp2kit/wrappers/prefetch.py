"""Explicit forward and backward prefetch of the blocks' all-gathers (docs/internals.md)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from fsdp2kit._internal.markers import BLOCK_ORDER
from fsdp2kit.wrappers.forward import ORDER

__all__ = ["set_prefetch"]


def set_prefetch(model: nn.Module, forward: int = 1, backward: int = 1) -> nn.Module:
    """Prefetch the all-gathers of the next ``forward`` blocks in forward and the previous ``backward`` blocks
    in backward; returns ``model``. Call it after `shard_model`; calling it again replaces the setting.

    ``backward=1`` is FSDP2's implicit default made explicit; ``0`` returns to FSDP2's default in that
    direction. Only the blocks prefetch each other; the embedding and root units keep FSDP2's default.
    """
    for name, value in (("forward", forward), ("backward", backward)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an int >= 0 (how many blocks ahead to prefetch; 0: off)")
    blocks = getattr(model, BLOCK_ORDER, None)
    if blocks is None or not all(isinstance(b, FSDPModule) for b in blocks):  # the blocks shard_model recorded
        raise ValueError(f"set_prefetch must be called on the model after shard_model (the order is {ORDER})")
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + forward])
        # Nearest first: that is the order backward reaches them.
        block.set_modules_to_backward_prefetch(blocks[max(0, i - backward) : i][::-1])
    return model
