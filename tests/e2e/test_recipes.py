"""recipes/train.py as a user runs it: torchrun, 2 CPU processes, the embedded demo data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert full[40]["loss"] < 0.7 * full[1]["loss"], f"loss did not fall: {full[1]['loss']} -> {full[40]['loss']}"
    assert (tmp_path / "full" / "ckpt" / "step_00000040").is_dir()
    assert "done: steps 0 -> 40" in out

    # rank 1 is SIGKILLed at step 25; torchrun restarts the workers, which resume from step 20 and
    # log the same losses afterwards, bitwise. (A resume by a second launch is checked by
    # tests/e2e/test_long_runs.py, after a preemption signal.)
    _, out = train(tmp_path, "killed", 40, ["--train.fail_at_step", "25"], restarts=1)
    assert "resumed from" in out and "step_00000020" in out
    killed = records(tmp_path / "killed" / "log.jsonl")
    assert [killed[s]["loss"] for s in (30, 40)] == [full[s]["loss"] for s in (30, 40)]


@pytest.mark.timeout(300)
def test_smoke_passes(tmp_path):
    _, out = run(["--config", DEMO, *FAST, "--train.smoke", "true", "--checkpoint.dir", str(tmp_path / "ck")], tmp_path)
    assert "smoke: 4/4 checks passed" in out, out[-3000:]
    assert out.count("PASS") == 4


@pytest.mark.timeout(300)
def test_bad_configs_fail_at_once_naming_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstepz = 3\n")
    code, out = run(["--config", str(bad)], tmp_path, nproc=None, check=False)
    assert code != 0 and "unknown key train.stepz" in out
    code, out = run(["--config", DEMO, "--parallel.shard", "3"], tmp_path, check=False)
    assert code != 0 and "does not fit the world size 2" in out
    code, out = run(["--config", DEMO, "--data.files", str(tmp_path / "nope.jsonl")], tmp_path, check=False)
    assert code != 0 and "nope.jsonl does not exist" in out
    code, out = run(["--config", DEMO, "--optim.name", "adamw_bf16sr"], tmp_path, nproc=None, check=False)
    assert code != 0 and "config error: optim.name=adamw_bf16sr" in out and "pure_bf16" in out


@pytest.mark.timeout(120)
def test_help_lists_every_option(tmp_path):
    _, out = run(["--help"], tmp_path, nproc=None)
    assert "--train.warmup INT" in out and "cosine decay to 10% of lr" in out and "(default: 30)" in out
    assert "--parallel.activation_checkpointing STR" in out and "--checkpoint.async_save BOOL" in out


@pytest.mark.timeout(120)
def test_real_scale_plans_on_cpu(tmp_path):
    _, out = run(
        ["--config", str(ROOT / "recipes/configs/llama3_8b_8gpu.toml"), "--train.plan_only", "true"],
        tmp_path,
        nproc=None,
    )
    assert "8.03B" in out and "mesh (shard=8)" in out and "(sum 15.0 GiB)" in out
    _, out = run(
        ["--config", str(ROOT / "recipes/configs/llama3_70b_2x8gpu.toml"), "--train.plan_only", "true"],
        tmp_path,
        nproc=None,
    )
    assert "70.55B" in out and "mesh (replicate=2 x shard=8)" in out and "strategy HYBRID_SHARD" in out
