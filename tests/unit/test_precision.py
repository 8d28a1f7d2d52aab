"""Master weights by name: the precision policies, the plan's precision line, the warning, `fsdp2kit plan` on a
bf16 checkpoint directory. The multi-rank training runs are in tests/dist/test_masters.py."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from models import tiny_llama
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp2kit as fk
from fsdp2kit.cli import main
from fsdp2kit.precision import resolve_precision


def _bf16_llama(meta: bool = True):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return tiny_llama().to(torch.bfloat16)
    return tiny_llama().to(torch.bfloat16)


def test_names_resolve_to_a_master_dtype():
    assert resolve_precision("bf16").master_dtype == torch.float32
    assert resolve_precision("fp16").master_dtype == torch.float32
    assert resolve_precision("fp32").master_dtype == torch.float32
    pure = resolve_precision("PURE_BF16")
    assert pure.name == "pure_bf16" and pure.master_dtype == torch.bfloat16
    assert pure.policy.param_dtype == torch.bfloat16 and pure.policy.reduce_dtype == torch.float32
    assert resolve_precision(None).master_dtype is None  # as built
    custom = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert resolve_precision(custom).policy is custom and resolve_precision(custom).master_dtype is None
    with pytest.raises(ValueError, match="mixed_precision='bf32': expected None, one of .*'pure_bf16'"):
        resolve_precision("bf32")


def test_plan_names_master_and_state_dtypes():
    model = _bf16_llama()
    n = sum(p.numel() for p in model.parameters())
    bf16 = fk.estimate_plan(model, shard=1, mixed_precision="bf16")
    line = str(bf16).splitlines()[1]
    assert line == (
        "master weights fp32 (cast from bf16 at sharding), gradients fp32, AdamW state fp32; "
        "compute bf16, gradient reduction fp32"
    )
    assert bf16.master_dtype == bf16.state_dtype == "fp32"
    assert bf16.param_bytes_per_rank == 4 * n and bf16.adam_bytes_per_rank == 8 * n
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # planning changes nothing

    pure = fk.estimate_plan(model, shard=1, mixed_precision="pure_bf16")
    assert (
        str(pure)
        .splitlines()[1]
        .startswith(
            "master weights bf16, gradients bf16, AdamW state bf16; compute bf16, gradient reduction fp32; "
            "bf16 masters chosen (pure_bf16)"
        )
    )
    assert pure.param_bytes_per_rank == 2 * n and pure.adam_bytes_per_rank == 4 * n

    built = fk.estimate_plan(model, shard=1)
    assert "precision as built" in str(built)
    assert str(built).splitlines()[1].endswith("bf16 masters as built: mixed_precision='bf16' would keep fp32 masters")

    # a frozen base keeps its storage dtype: only the trainable parameters are cast
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    frozen = fk.estimate_plan(model, shard=1, mixed_precision="bf16")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert frozen.param_bytes_per_rank == 2 * n + 2 * trainable and frozen.grad_bytes_per_rank == 4 * trainable


def test_shard_model_casts_trainable_shards_and_warns_as_built(mesh):
    model = _bf16_llama(meta=False)
    model.model.layers[0].mlp.requires_grad_(False)  # frozen: stays bf16
    values = {n: p.detach().float() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a named policy is a choice: no warning
        plan = fk.shard_model(model, mesh, mixed_precision="bf16")
    for name, p in model.named_parameters():
        want = torch.bfloat16 if ".mlp." in name and "layers.0" in name else torch.float32
        assert p.dtype == want, name
        assert torch.equal(p.full_tensor().float(), values[name]), name
    assert plan.param_bytes_per_rank == sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    with pytest.warns(UserWarning, match=r"mixed_precision=None\) trains the parameters as built: \d+ trainable "):
        plan = fk.shard_model(_bf16_llama(), mesh)
    assert plan.master_dtype == "bf16"


def test_memory_plan_names_master_and_state_dtypes():
    model = _bf16_llama()
    plans = {mp: fk.plan_memory(model, shard=2, batch=1, seq=16, mixed_precision=mp) for mp in ("bf16", "pure_bf16")}
    assert plans["bf16"].config["master_dtype"] == plans["bf16"].config["state_dtype"] == "fp32"
    assert plans["pure_bf16"].config["master_dtype"] == plans["pure_bf16"].config["state_dtype"] == "bf16"
    assert str(plans["bf16"]).splitlines()[1] == "master weights fp32, optimizer state fp32"
    for part in ("params", "optimizer"):
        assert plans["bf16"].parts[part] == 2 * plans["pure_bf16"].parts[part], part


def test_cli_plan_on_a_bf16_checkpoint_dir(tmp_path, capsys):
    _bf16_llama(meta=False).save_pretrained(tmp_path)
    n = sum(p.numel() for p in tiny_llama().parameters())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    for mp, master in (("bf16", "fp32"), ("pure_bf16", "bf16")):
        assert main(["plan", str(tmp_path), "--shard", "1", "--mixed-precision", mp]) == 0
        out = capsys.readouterr().out
        assert f"master weights {master}" in out and f"AdamW state {master}" in out
        assert f"precision {mp}" in out
        memory = ["plan", str(tmp_path), "--shard", "1", "--batch", "1", "--seq", "16", "--json"]
        assert main([*memory, "--mixed-precision", mp]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["config"]["master_dtype"] == data["config"]["state_dtype"] == master
        assert data["parts"]["params"] == n * (4 if master == "fp32" else 2)
        assert data["parts"]["optimizer"] == 2 * data["parts"]["params"]
