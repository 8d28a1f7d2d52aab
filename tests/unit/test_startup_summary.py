"""The recipe's start-up lines (recipes/support/startup.py) for the cases a demo launch does not show:
a LoRA run, no log file, the full plans already on the console, and a memory plan that could not be made."""

from __future__ import annotations

import torch

from fsdp2kit.models import build_causal_lm
from fsdp2kit.planner.api import plan_shards
from support.options import Config
from support.startup import memory_plan, summary


def test_lora_run_without_a_log_and_no_memory_plan():
    cfg = Config()
    cfg.model.name, cfg.lora.r, cfg.lora.targets = "demo", 8, "q_proj,v_proj"
    cfg.log.jsonl, cfg.log.verbose, cfg.checkpoint.every = "", True, 0
    model = build_causal_lm("demo", meta=True)
    plan = plan_shards(model, shard=2, lora=8, lora_targets=("q_proj", "v_proj"))
    cfg.parallel.activation_checkpointing = "sometimes"  # the planner refuses it: advice, not a failure
    memory = memory_plan(model, cfg, shard=2, replicate=1, device="cpu")
    assert isinstance(memory, str) and memory.startswith("memory plan unavailable: ValueError: "), memory
    lines = summary(cfg, plan, memory, torch.device("cpu")).splitlines()
    # 4 blocks x 2 targets x r=8 x (128 + 128) adapter values (hidden 128, 4 heads of 32), all trained
    assert (
        lines[0].startswith("model demo: ")
        and "(16.38K trained, LoRA r=8 on q_proj,v_proj) in 6 FSDP units" in lines[0]
    )
    assert lines[1] == f"precision: {plan.precision_line}"
    assert lines[2:] == [memory, "log: none", "checkpoints: outputs/ckpt (at the end)"]


def test_pure_bf16_with_round_to_nearest_adamw_is_said():
    cfg = Config()
    cfg.parallel.mixed_precision = "pure_bf16"
    model = build_causal_lm("demo", meta=True)
    plan = plan_shards(model, shard=2, mixed_precision="pure_bf16")
    line = summary(cfg, plan, "memory plan unavailable", torch.device("cpu")).splitlines()[1]
    assert "master weights bf16" in line and "optim.name=adamw_bf16sr rounds them stochastically" in line, line
    cfg.optim.name = "adamw_bf16sr"
    line = summary(cfg, plan, "memory plan unavailable", torch.device("cpu")).splitlines()[1]
    assert "adamw_bf16sr state bf16" in line and "round-to-nearest" not in line, line
