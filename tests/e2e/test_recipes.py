"""recipes/train.py as a user runs it: torchrun, 2 CPU processes, the embedded demo data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_recipe_plans import plans_agree

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "recipes" / "train.py")
DEMO = str(ROOT / "recipes" / "configs" / "demo.toml")
# Small and quick: a short sequence, logging every 10 steps.
FAST = ["--data.seq_len", "64", "--log.every", "10", "--log.progress", "false"]


def run(args: list[str], tmp: Path, *, nproc: int | None = 2, restarts: int = 0, check: bool = True):
    launcher = [sys.executable]
    if nproc:
        launcher += [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}",
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, TRAIN, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, out[-6000:]
    return proc.returncode, out


def startup(out: str) -> list[str]:
    """The lines a launch prints before its first step's line (rank 0's stdout comes first in ``out``)."""
    return out[: out.index("\nstep 1 ")].splitlines()


def records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def train(tmp: Path, name: str, steps: int, extra: list[str] = (), **kw):
    args = [
        "--config",
        DEMO,
        *FAST,
        "--train.steps",
        str(steps),
        "--checkpoint.every",
        "10",
        "--checkpoint.dir",
        str(tmp / name / "ckpt"),
        "--log.jsonl",
        str(tmp / name / "log.jsonl"),
        *extra,
    ]
    return run(args, tmp, **kw)


@pytest.mark.timeout(900)
def test_train_resume_and_survive_a_killed_worker(tmp_path):
    # uninterrupted
    _, out = train(tmp_path, "full", 40)
    full = records(tmp_path / "full" / "log.jsonl")
    # Quiet by default (issue 27): the data, then five lines; the full plans only in the log's start event.
    lines, log = startup(out), tmp_path / "full" / "log.jsonl"
    expected = ["data train: ", "data cache: ", "model demo: 940.16K parameters (940.16K trained) in 6 FSDP units, "]
    expected += ["precision: master weights fp32, gradients fp32, AdamW state fp32; ", "memory: predicted peak "]
    expected += [f"log: {log} (the full memory plan and ShardPlan are in its start event; --log.verbose true prints"]
    expected += [f"checkpoints: {tmp_path / 'full' / 'ckpt'} (every 10 steps and at the end)"]
    assert len(lines) == len(expected) and all(a.startswith(b) for a, b in zip(lines, expected)), lines
    assert "Memory plan: " not in out and "ShardPlan: " not in out  # the tables themselves
    start = json.loads(log.read_text().splitlines()[0])
    assert start["event"] == "start" and start["memory_plan"].startswith("Memory plan: demo on shard=2, batch 8 x")
    assert start["shard_plan"].startswith("ShardPlan: 6 FSDP units over mesh (shard=2)"), start["shard_plan"]
    assert plans_agree(start["memory_plan"] + "\n" + start["shard_plan"])
    # the first step's collectives, counted (fsdp2kit.count_collectives): FSDP2's and the clipping norm's
    events = [json.loads(line) for line in log.read_text().splitlines()]
    counted = [e for e in events if e.get("event") == "collectives"]
    assert [e["step"] for e in counted] == [1] and counted[0]["accumulation"] == "regather", counted
    shard = counted[0]["groups"]["shard"]
    assert shard["all_gather"]["count"] >= 6 and shard["reduce_scatter"]["count"] >= 6, shard
    assert shard["all_gather"]["dtypes"] == ["float32"] and shard["all_gather"]["ranks"] == 2, shard
    summary = [sys.executable, str(ROOT / "recipes" / "summary.py"), str(log)]
    shown = subprocess.run([*summary, "--plans"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert shown == f"{start['memory_plan']}\n{start['shard_plan']}\n"
    shown = subprocess.run(summary, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "GiB per rank (max; process RSS)" in shown, shown
    # CPU memory figures named for what they are; the prediction is shown only beside the live bytes it predicts.
    assert {"peak_rss_gib", "peak_rss_gib_per_rank"} <= set(full[1]) and "peak_mem_gib" not in full[1]
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps and all(("predicted_peak_gib" in s) == ("peak_live_gib" in s) for s in steps), steps
    assert "peak_live_gib" in full[10] and "predicted_peak_gib" in full[10]
    assert full[40]["loss"] < 0.7 * full[1]["loss"], f"loss did not fall: {full[1]['loss']} -> {full[40]['loss']}"
    assert (tmp_path / "full" / "ckpt" / "step_00000040").is_dir()
    assert "done: steps 0 -> 40" in out

    # rank 1 is SIGKILLed at step 25; torchrun restarts the workers, which resume from step 20 and
    # log the same losses afterwards, bitwise. (A resume by a second launch is checked by
    # tests/e2e/test_long_runs.py, after a preemption signal.)
    _, out = train(tmp_path, "killed", 40, ["--train.fail_at_step", "25"], restarts=1)
    assert "resumed from" in out and "step_00000020" in out
    # rank 0's report names the dead rank (its signal while it is unreaped) and rank 0's own step now
    assert re.search(r"Rank 1 is gone: its process \(pid \d+\) (was killed by SIGKILL|has exited)\.", out), out[-6000:]
    assert "Diverged: rank 1." in out and "rank 0: step 26, " in out, out[-6000:]
    assert re.search(r"rank 1: gone; its (last position, published [\d.]+ s before: |published no position)", out)
    killed = records(tmp_path / "killed" / "log.jsonl")
    assert [killed[s]["loss"] for s in (30, 40)] == [full[s]["loss"] for s in (30, 40)]


@pytest.mark.timeout(300)
def test_smoke_passes(tmp_path):
    _, out = run(["--config", DEMO, *FAST, "--train.smoke", "true", "--checkpoint.dir", str(tmp_path / "ck")], tmp_path)
    assert "smoke: 4/4 checks passed" in out, out[-3000:]
    assert out.count("PASS") == 4
    # Its round-trip checkpoint went beside the checkpoint directory, not into it, and is gone.
    assert f"(in {tmp_path / 'ck.smoke'}, now removed)" in out, out[-3000:]
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.smoke").exists()


@pytest.mark.timeout(120)
def test_help_lists_every_option(tmp_path):
    _, out = run(["--help"], tmp_path, nproc=None)
    assert "--train.warmup INT" in out and "cosine decay to 10% of lr" in out and "(default: 30)" in out
    assert "--parallel.activation_checkpointing STR" in out and "--checkpoint.async_save BOOL" in out
    words = " ".join(out.split())  # argparse wraps at the terminal's width
    assert "--export.merge BOOL with [lora]: true writes the base with the adapters merged in" in words
    assert "false writes a PEFT adapter directory" in words and "<checkpoint.dir>.smoke, removed" in words
    assert "--log.verbose BOOL print the full memory plan and ShardPlan at start-up" in words


@pytest.mark.timeout(120)
def test_real_scale_plans_on_cpu(tmp_path):
    _, out = run(
        ["--config", str(ROOT / "recipes/configs/llama3_8b_8gpu.toml"), "--train.plan_only", "true"],
        tmp_path,
        nproc=None,
    )
    assert "8.03B" in out and "mesh (shard=8)" in out and "(sum 15.0 GiB)" in out
    # plan_only prints the memory plan too, planned for GPUs, of the same model as the ShardPlan
    assert "Memory plan: llama3-8b on shard=8, batch 1 x seq 8192, AC full, precision bf16" in out, out
    assert plans_agree(out)
    _, out = run(
        ["--config", str(ROOT / "recipes/configs/llama3_70b_2x8gpu.toml"), "--train.plan_only", "true"],
        tmp_path,
        nproc=None,
    )
    assert "70.55B" in out and "mesh (replicate=2 x shard=8)" in out and "strategy HYBRID_SHARD" in out
