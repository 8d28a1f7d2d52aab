"""`fsdp2kit export-hf` and `fsdp2kit plan` as a user runs them (in-process, through main)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from models import tiny_llama
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM

from fsdp2kit.cli import main


def _save_step(model, root, step: int) -> None:
    path = root / f"step_{step:08d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path), no_dist=True)
    model.config.save_pretrained(path)


def test_export_hf_round_trips_through_from_pretrained(tmp_path, capsys):
    torch.manual_seed(0)
    old, new = tiny_llama(tied=True), tiny_llama(tied=True)
    _save_step(old, tmp_path / "ck", 1)
    _save_step(new, tmp_path / "ck", 2)
    tokens = torch.randint(0, 96, (2, 10))

    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0  # newest step
    assert "wrote" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    for key, value in new.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
    torch.testing.assert_close(loaded(tokens).logits, new(tokens).logits, rtol=0, atol=0)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight

    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf1"), "--step", "1", "--dtype", "bf16"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf1")
    assert loaded.dtype == torch.bfloat16
    torch.testing.assert_close(
        loaded.model.embed_tokens.weight, old.model.embed_tokens.weight.bfloat16(), rtol=0, atol=0
    )

    # auto: the dtype the step's config names (a bf16 checkpoint's, here), the weights saved in fp32
    old.config.dtype = torch.bfloat16
    _save_step(old, tmp_path / "ck", 3)
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf4"), "--step", "3", "--dtype", "auto"]) == 0
    with safe_open(tmp_path / "hf4" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 - not iterable

    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf2"), "--step", "7"]) == 1
    assert "step 7 is not a complete step" in capsys.readouterr().err
    assert main(["export-hf", str(tmp_path / "missing"), str(tmp_path / "hf3")]) == 1
    assert "no checkpoint directory" in capsys.readouterr().err


def test_plan(capsys):
    assert main(["plan", "llama3-70b", "--shard", "8", "--replicate", "2", "--mixed-precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "70.55B" in out and "replicate=2 x shard=8" in out and "precision bf16" in out
    assert main(["plan", "gpt-17", "--shard", "2"]) == 1
    assert "unknown model name 'gpt-17'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "demo"])  # --shard is required
