"""recipes/train.py QLoRA from a pretrained directory, as a user runs it: torchrun, 2 CPU processes.

The model is built on the meta device and load_pretrained quantizes each rank's rows into its NF4
shards (tests/dist/test_qlora_load.py checks those shards bit for bit against quantize-then-shard);
here the recipe wires it up, plans it with the LoRA/QLoRA figures and trains.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_qlora_recipe_from_pretrained_dir(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=768, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")  # a bf16 checkpoint
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "recipes" / "train.py"), "--config", str(ROOT / "recipes" / "configs" / "demo.toml"),
        "--model.name", str(tmp_path / "base"), "--model.pretrained", "true", "--lora.r", "8", "--lora.alpha", "16",
        "--lora.qlora", "true", "--parallel.mixed_precision", "bf16", "--train.steps", "4", "--data.seq_len", "64",
        "--log.every", "1", "--log.progress", "false", "--checkpoint.dir", str(tmp_path / "ckpt"), "--log.jsonl", "",
        "--export.hf_dir", "", "--log.verbose", "true",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "done: steps 0 -> 4" in out and "PeftModel" in out
    # The memory plan counts the model the ShardPlan shows: NF4 base, the adapters' gradients and AdamW state.
    memory = re.search(r"per rank, all step: parameters (.+?), gradients (.+?), optimizer state (.+?)$", out, re.M)
    shard = re.search(r"per rank: parameters (.+?), gradients (.+?), Adam state (.+?) \(sum", out, re.M)
    assert memory and shard and memory.groups() == shard.groups(), out[-4000:]
    # An untrained 768-token model starts near ln(768) = 6.64: the base was loaded and quantized, not left empty.
    first = float(re.search(r"step 1  loss ([0-9.]+)", out).group(1))
    assert 6.0 < first < 7.5, first
