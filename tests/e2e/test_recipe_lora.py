"""recipes/train.py with a [lora] table, as a user runs it: torchrun, 2 CPU processes, the demo data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# replicated: the adapters whole on every rank, 2 micro-batches a step under keep_gathered (docs/accumulation.md)
REPLICATED = ["--lora.replicate_adapters", "true", "--train.grad_accum", "2", "--train.accumulation", "keep_gathered"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("extra", [[], REPLICATED], ids=["sharded", "replicated"])
def test_lora_recipe_trains_and_resumes(tmp_path, extra):
    def run(steps: int) -> str:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "recipes" / "train.py"), "--config", str(ROOT / "recipes" / "configs" / "demo.toml"),
            "--data.seq_len", "64", "--log.progress", "false", "--log.every", "5", "--train.steps", str(steps),
            "--checkpoint.every", "10", "--checkpoint.dir", str(tmp_path / "ckpt"), "--log.jsonl", "",
            "--parallel.mixed_precision", "bf16", "--lora.r", "8", "--lora.alpha", "16",
            "--lora.targets", "q_proj,v_proj,down_proj", *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        return proc.stdout + proc.stderr

    out = run(10)
    assert "done: steps 0 -> 10" in out and "LoRA r=8 on q_proj,v_proj,down_proj) in 6 FSDP units" in out
    info = json.loads((tmp_path / "ckpt" / "step_00000010" / "fsdp2kit.json").read_text())
    assert info["trainable_only"] is True  # the frozen base is not in the checkpoint
    out = run(15)
    assert "done: steps 10 -> 15" in out  # resumed from the adapters-only checkpoint
