"""wrap_fsdp1 speaks shard_model's option names and rejects what FSDP1 cannot do, before wrapping."""

from __future__ import annotations

import pytest
import torch
from fsdp1 import fsdp1_mixed_precision, fsdp1_sharding_strategy, wrap_fsdp1
from models import build
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy


def test_strategy_names(mesh):
    assert fsdp1_sharding_strategy(None, mesh) is ShardingStrategy.FULL_SHARD
    assert fsdp1_sharding_strategy("shard_grad_op", mesh) is ShardingStrategy.SHARD_GRAD_OP
    with pytest.raises(ValueError, match="HYBRID_SHARD needs a 2-D mesh"):
        fsdp1_sharding_strategy("HYBRID_SHARD", mesh)
    with pytest.raises(ValueError, match="expected one of"):
        wrap_fsdp1(build("llama"), mesh, strategy="ZERO3")


def test_mixed_precision_names():
    assert fsdp1_mixed_precision(None) is None and fsdp1_mixed_precision("fp32") is None
    bf16 = fsdp1_mixed_precision("bf16")
    assert bf16.param_dtype is torch.bfloat16 and bf16.reduce_dtype is torch.float32 and bf16.buffer_dtype is None


def test_units_and_bad_prefetch(mesh):
    with pytest.raises(ValueError, match="backward_prefetch='PRE'"):
        wrap_fsdp1(build("llama"), mesh, backward_prefetch="PRE")
    model = wrap_fsdp1(build("llama"), mesh)
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    assert len(units) == 1 + 3 + 1  # root, 3 blocks, the untied embedding
