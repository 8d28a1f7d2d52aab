"""The recipe fine-tuning a checkpoint stored in bf16, as a user runs it: fp32 master weights and AdamW
state under `[parallel] mixed_precision = "bf16"`, said in its first lines and its start event, and
in the checkpoint it writes; bf16 only when `"pure_bf16"` asks for it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from test_recipes import DEMO, FAST, run

from fsdp2kit.cli import main as cli


def _bf16_checkpoint(path) -> None:
    """The demo model and tokenizer, saved in bf16 (the usual published dtype)."""
    from fsdp2kit.models import build_causal_lm
    from support.tokenizer import train_demo_tokenizer

    tok = train_demo_tokenizer(path)
    torch.manual_seed(0)
    model = build_causal_lm("demo", vocab_size=len(tok), meta=False)
    model.to(torch.bfloat16).save_pretrained(path)


@pytest.mark.timeout(400)
def test_bf16_checkpoint_fine_tunes_fp32_masters(tmp_path, capsys):
    base = tmp_path / "base"
    _bf16_checkpoint(base)
    assert json.loads((base / "config.json").read_text())["dtype"] == "bfloat16"
    common = ["--config", DEMO, *FAST, "--model.name", str(base), "--model.pretrained", "true"]
    common += ["--data.tokenizer", str(base)]

    log = tmp_path / "log.jsonl"
    args = [*common, "--parallel.mixed_precision", "bf16", "--train.steps", "2", "--train.lr", "2e-5"]
    export = tmp_path / "export"  # [export] dtype = "auto" (the default): the checkpoint's bf16 again
    args += ["--export.hf_dir", str(export)]
    _, out = run([*args, "--checkpoint.dir", str(tmp_path / "ck"), "--log.jsonl", str(log)], tmp_path)
    # the start-up summary says it; the memory plan (in the log's start event) too
    assert "precision: master weights fp32 (cast from bf16 at sharding), gradients fp32, AdamW state fp32" in out
    assert "trains the parameters as built" not in out
    start = next(r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "start")
    assert "\nmaster weights fp32, optimizer state fp32\n" in start["memory_plan"]
    assert start["master_dtype"] == start["optimizer_state_dtype"] == "fp32"
    # what the checkpoint holds: fp32 weights and fp32 AdamW moments
    assert cli(["inspect", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    dtypes = set(re.findall(r"\b(float32|bfloat16|fp32|bf16)\b", text))
    assert dtypes and dtypes <= {"float32", "fp32"}, text[-3000:]

    assert "exported a Hugging Face model (bfloat16)" in out
    with safe_open(export / "model.safetensors", "pt") as f:
        stored = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    assert stored == {"BF16"} and json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"

    # the other choice, said as loudly: planned without a launch (without mixed_precision the plan
    # says "bf16 masters as built": tests/unit/test_precision.py)
    plan = ["--train.plan_only", "true", "--parallel.shard", "2"]
    _, out = run([*common, *plan, "--parallel.mixed_precision", "pure_bf16"], tmp_path, nproc=None)
    assert "master weights bf16, gradients bf16, AdamW state bf16" in out
