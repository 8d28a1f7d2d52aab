"""recipes/train.py as a new user runs it (issue 27): the memory plan and the ShardPlan it prints describe one
model, a sequence past the model's positions is refused unless the limit is raised, and the export carries
its tokenizer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.tokenizer import train_demo_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [str(ROOT / "recipes" / "train.py"), "--config", str(ROOT / "recipes" / "configs" / "demo.toml")]
QUIET = ["--log.progress", "false", "--log.jsonl", ""]
# The memory plan's and the ShardPlan's per-rank state lines (fsdp2kit/planner/report.py, fsdp2kit/plan.py).
MEMORY = re.compile(r"per rank, all step: parameters (.+?), gradients (.+?), optimizer state (.+?)$", re.M)
SHARD = re.compile(r"per rank: parameters (.+?), gradients (.+?), Adam state (.+?) \(sum", re.M)


def plans_agree(out: str) -> tuple[str, str, str]:
    memory, shard = MEMORY.search(out), SHARD.search(out)
    assert memory and shard, out[-4000:]
    assert memory.groups() == shard.groups(), (memory.group(0), shard.group(0))
    return memory.groups()


def model_dir(path: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=1024, max_position_embeddings=256,
    ).save_pretrained(path)  # fmt: skip
    return path


@pytest.mark.timeout(120)
def test_a_sequence_past_the_models_positions_is_refused_before_any_process_group(tmp_path):
    base = model_dir(tmp_path / "pos256")
    cmd = [sys.executable, *TRAIN, "--model.name", str(base), "--data.seq_len", "512", *QUIET]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"config error: data.seq_len 512 exceeds the model's max_position_embeddings 256 ({base}): lower "
        "--data.seq_len, or raise the limit explicitly with --model.max_position_embeddings 512\n"
    )


@pytest.mark.timeout(300)
def test_lora_plans_agree_and_the_export_has_its_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    base = model_dir(tmp_path / "pos256")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *TRAIN, *QUIET,
        "--model.name", str(base), "--data.seq_len", "512", "--model.max_position_embeddings", "512",
        "--data.batch_size", "2", "--parallel.mixed_precision", "bf16", "--lora.r", "8",
        "--lora.targets", "q_proj,k_proj,v_proj,o_proj", "--train.steps", "1", "--checkpoint.dir", str(tmp_path / "ck"),
        "--export.hf_dir", str(tmp_path / "hf"), "--log.verbose", "true",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # --log.verbose prints both plans, before the start-up summary that every launch prints.
    assert out.index("Memory plan: ") < out.index("ShardPlan: ") < out.index("\nmodel ") < out.index("\nstep 1 ")
    assert "LoRA r=8 on q_proj,k_proj,v_proj,o_proj" in out
    assert "is_gradient_checkpointing" not in out  # peft's deprecation warning, filtered in the recipe's scope
    # Adapters on q/k/v/o only: 2 blocks x 4 targets x r=8 x (64 + 64) = 8192 fp32 values, half a rank: 16 KiB.
    assert plans_agree(out)[1] == "16.0 KiB"
    assert AutoConfig.from_pretrained(tmp_path / "hf").max_position_embeddings == 512  # the raised limit, exported
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    demo = train_demo_tokenizer()  # the run's: the demo BPE, trained the same way into its data cache
    assert len(tok) == len(demo) and tok("the cat sleeps")["input_ids"] == demo("the cat sleeps")["input_ids"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tok.eos_token_id
