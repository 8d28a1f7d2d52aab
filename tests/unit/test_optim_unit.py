"""make_optimizer's names, the planner's state bytes against torchao's real allocation, the recipe's [optim] table."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp2kit as fk
from fsdp2kit.optim import OPTIMIZERS, block_for, state_bytes
from fsdp2kit.planner.live import tensor_storages
from fsdp2kit.planner.parts import OPTIMIZERS as PLANNER_OPTIMIZERS
from fsdp2kit.planner.parts import optimizer_bytes


def _model(dtype=torch.float32) -> nn.Module:
    # weights of 128 rows of 256 (the class's block), 40 rows of 128 (8-bit: blocks of 128), 104 rows of
    # 40 (blocks of 40, though 4160 elements are no multiple of 256), biases (1-D: full precision)
    return nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 40), nn.Linear(40, 104)).to(dtype)


def _measured(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    storages = {id(s): s.nbytes() for v in opt.state[p].values() if v.dim() > 0 for s in tensor_storages(v)}
    return sum(storages.values())


def test_planner_names_are_make_optimizer_names():
    assert fk.OPTIMIZERS == OPTIMIZERS == ("adamw", "adamw8bit", "adamw4bit", "adamw_fp8", "adamw_bf16sr")
    assert (*OPTIMIZERS, "sgd") == PLANNER_OPTIMIZERS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_bytes_match_the_real_optimizer(name):
    dtype = torch.bfloat16 if name == "adamw_bf16sr" else torch.float32
    model = _model(dtype)
    opt = fk.make_optimizer(model, name, lr=1e-3)
    params = list(model.parameters())
    if name == "adamw":
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
    else:  # torchao's own allocation (the step would compile it; the state is made the same way)
        for p in params:
            opt.state[p].update(exp_avg=opt._new_buffer(p, True), exp_avg_sq=opt._new_buffer(p, False))
    measured = [_measured(opt, p) for p in params]
    predicted = [state_bytes(p.numel(), p.dtype, name, p.shape) for p in params]
    assert measured == predicted
    assert optimizer_bytes([(p.numel(), p.dtype, p.shape) for p in params], name).state == sum(measured)
    if name in ("adamw8bit", "adamw4bit", "adamw_fp8"):  # the weights really are quantized
        assert all(m < p.numel() * 4 for m, p in zip(measured[::2], params[::2]))  # under half an fp32 pair


def test_blocks_divide_rows_and_follow_the_global_shape():
    assert block_for((4096, 4096), 256) == 256 and block_for((4096, 4096), 128) == 128
    assert block_for((128, 128), 256) == 128  # torchao alone: 256, crossing rows
    assert block_for((40, 160), 256) == 160 and block_for((104, 40), 256) == 40 and block_for((64, 100), 128) == 100
    assert block_for((64, 64), 256) == 64  # 4096 elements: the smallest quantized
    assert block_for((63, 64), 256) is None and block_for((8192,), 256) is None  # too small; 1-D
    assert block_for((200, 30), 256) is None and block_for((2, 4098), 256) is None  # rows' divisors too small
    assert block_for((8, 2, 256), 256) == 256  # a row is every dim but the first


def test_planner_refuses_what_make_optimizer_refuses():
    from fsdp2kit.planner.api import Settings

    Settings(shard=2, batch=1, seq=8, optimizer="adamw_bf16sr", mixed_precision="pure_bf16").check()
    with pytest.raises(ValueError, match="pure_bf16"):
        Settings(shard=2, batch=1, seq=8, optimizer="adamw_bf16sr", mixed_precision="bf16").check()


def test_refusals():
    model = _model()
    with pytest.raises(ValueError, match="adamw, adamw8bit, adamw4bit, adamw_fp8, adamw_bf16sr"):
        fk.make_optimizer(model, "adam8bit", lr=1e-3)
    with pytest.raises(ValueError, match="pure_bf16"):
        fk.make_optimizer(model, "adamw_bf16sr", lr=1e-3)
    with pytest.raises(ValueError, match="not on a CUDA device.*nothing to offload"):
        fk.make_optimizer(model, "adamw", lr=1e-3, offload=True)
    with pytest.raises(ValueError, match="offload is for 'adamw'"):
        fk.make_optimizer(model, "adamw4bit", lr=1e-3, offload=True)
    with pytest.warns(UserWarning, match="6 trainable parameter.*adamw_bf16sr"):  # pure_bf16, round-to-nearest
        fk.make_optimizer(_model(torch.bfloat16), "adamw", lr=1e-3)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        fk.make_optimizer(model, "adamw", lr=1e-3)


def test_recipe_optim_table():
    from support.options import Config, OptimConfig, ParallelConfig, TrainConfig, optimizer_args

    adam = {"betas": (0.9, 0.999), "eps": 1e-8}
    assert optimizer_args(Config()) == {"name": "adamw", "offload": False, "lr": 3e-3, "weight_decay": 0.1, **adam}
    older = Config(train=TrainConfig(lr=1e-4, weight_decay=0.0))  # configs written before [optim]
    assert optimizer_args(older) == {"name": "adamw", "offload": False, "lr": 1e-4, "weight_decay": 0.0, **adam}
    newer = Config(optim=OptimConfig(name="adamw8bit", lr=2e-4))
    assert optimizer_args(newer)["lr"] == 2e-4 and optimizer_args(newer)["name"] == "adamw8bit"
    for cfg, match in [
        (Config(train=TrainConfig(lr=1e-4), optim=OptimConfig(lr=2e-4)), "set it once"),
        (Config(optim=OptimConfig(name="adamw_bf16sr")), "pure_bf16"),
        (Config(optim=OptimConfig(offload=True, name="adamw8bit")), "is for optim.name=adamw"),
    ]:
        with pytest.raises(ValueError, match=match):
            optimizer_args(cfg)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="has no GPU"):
            optimizer_args(Config(optim=OptimConfig(offload=True)))
    assert optimizer_args(Config(optim=OptimConfig(offload=True), train=TrainConfig(plan_only=True)))["offload"]
    from support.config import parse_config
    from support.errors import ConfigError

    with pytest.raises(ConfigError, match="optim.name = 'lion' .*expected one of adamw, adamw8bit"):
        parse_config(Config, ["--optim.name", "lion"], description="", prog="train.py")
    cfg = parse_config(Config, ["--optim.betas", "0.9, 0.95", "--optim.eps", "1e-6"], description="", prog="train.py")
    assert (optimizer_args(cfg)["betas"], optimizer_args(cfg)["eps"]) == ((0.9, 0.95), 1e-6)
    for flags, match in [
        (["--optim.betas", "0.9"], "beta1,beta2"),
        (["--optim.betas", "0.9,1.0"], r"\[0, 1\)"),
        (["--optim.eps", "-1"], ">= 0.0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_config(Config, flags, description="", prog="train.py")
    bf16 = Config(optim=OptimConfig(name="adamw_bf16sr"), parallel=ParallelConfig(mixed_precision="pure_bf16"))
    assert optimizer_args(bf16)["name"] == "adamw_bf16sr"
