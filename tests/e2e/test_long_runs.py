"""The recipe looking after itself under torchrun: a signal on one rank, a desync, a NaN, TensorBoard read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "recipes" / "train.py")
DEMO = str(ROOT / "recipes" / "configs" / "demo.toml")
STEPS = 24
FAST = ["--data.seq_len", "64", "--log.every", "2", "--log.progress", "false", "--checkpoint.every", "100"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=0"]
# fsdp2kit launch: the same launch, without torchrun's own traceback on Ctrl-C
LAUNCH = [str(Path(sys.executable).with_name("fsdp2kit")), "launch", "--nproc_per_node", "2", "--max-restarts", "0"]


def recipe_args(tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        TRAIN,
        "--config",
        DEMO,
        *FAST,
        "--train.steps",
        str(STEPS),
        "--checkpoint.dir",
        str(tmp / name / "ckpt"),
        "--log.jsonl",
        str(tmp / name / "log.jsonl"),
        *extra,
    ]


def env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def run(args: list[str], tmp: Path, launcher=TORCHRUN, **kw) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run([*launcher, *args], cwd=tmp, capture_output=True, text=True, timeout=400, **kw)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def worker_pid(parent: int, rank: int) -> int | None:
    """The torchrun worker of ``rank``: a child of the torchrun process whose environment says RANK=rank."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.timeout(900)
def test_a_signal_to_one_rank_saves_requeues_and_the_next_launch_resumes_bitwise(tmp_path):
    # The uninterrupted reference, logging to TensorBoard too.
    trk = tmp_path / "trk"
    code, out, _ = run(
        recipe_args(tmp_path, "ref", "--log.trackers", "tensorboard", "--log.tracker_dir", str(trk)), tmp_path
    )
    assert code == 0, out[-4000:]
    ref = losses(tmp_path / "ref" / "log.jsonl")

    # TensorBoard holds what the JSONL holds: read it back.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(trk / "tensorboard" / "run"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"loss", "lr", "grad_norm", "tokens_per_s", "peak_rss_gib", "peak_rss_gib_per_rank/rank_0"}
    assert expected | {"peak_rss_gib_per_rank/rank_1"} <= tags, tags
    tb_loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert set(tb_loss) == set(ref) and all(abs(tb_loss[s] - ref[s]) <= 1e-6 * abs(ref[s]) for s in ref)
    assert "config/text_summary" in acc.Tags()["tensors"]

    # A fake scontrol on PATH records the requeue that a Slurm job would get.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242")

    proc = subprocess.Popen(
        [*TORCHRUN, *recipe_args(tmp_path, "cut")],
        cwd=tmp_path,
        env=slurm,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, signalled = [], None
    for line in proc.stdout:
        lines.append(line)
        if signalled is None and line.startswith("step 4 "):
            signalled = worker_pid(proc.pid, 1)
            assert signalled, "rank 1's process was not found"
            os.kill(signalled, signal.SIGUSR1)  # ONE rank gets it, as a scheduler may do
    proc.wait(timeout=300)
    out = "".join(lines)
    assert signalled and proc.returncode != 0, out[-4000:]  # torchrun reports the workers' status 75
    assert "exitcode  : 75" in out or "exitcode: 75" in out, out[-4000:]
    line = next(ln for ln in lines if ln.startswith("preempted:"))
    assert "SIGUSR1 reached rank 1" in line and "Slurm job 4242 requeued" in line and "status 75" in line, line
    stopped = int(line.split("stopped after step ")[1].split(",")[0])
    assert 4 <= stopped < STEPS, line
    assert (tmp_path / "cut" / "ckpt" / f"step_{stopped:08d}").is_dir()
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]

    # The next launch resumes from that checkpoint, and is stopped by a Ctrl-C in its terminal:
    # SIGINT to torchrun's process group (torchrun forwards it to the workers, in sessions of their own).
    lines, code = ctrl_c(recipe_args(tmp_path, "cut"), tmp_path, after="step ")  # its first logged step
    out = "".join(lines)
    assert f"resumed from {tmp_path / 'cut' / 'ckpt'}/step_{stopped:08d}" in out, out[-4000:]
    line = next((ln for ln in lines if ln.startswith("stopped at step ")), None)
    assert line, out[-4000:]
    interrupted = int(line.split()[3])
    assert line == (
        f"stopped at step {interrupted} by SIGINT (Ctrl-C); checkpoint {tmp_path / 'cut' / 'ckpt'}/"
        f"step_{interrupted:08d}; relaunch the same command to resume\n"
    ), line
    assert stopped < interrupted < STEPS and (tmp_path / "cut" / "ckpt" / f"step_{interrupted:08d}").is_dir()
    assert "[rank" not in out and "KeyboardInterrupt" not in out, out[-4000:]  # no worker traceback

    # Relaunched, it resumes from there: the same losses as the reference, bitwise.
    code, out, _ = run(recipe_args(tmp_path, "cut"), tmp_path, env=env())
    assert code == 0 and f"resumed from {tmp_path / 'cut' / 'ckpt'}/step_{interrupted:08d}" in out, out[-4000:]
    cut = losses(tmp_path / "cut" / "log.jsonl")
    # Every run logs every 2 steps, and a resumed one also its first step (odd when it stopped at an
    # even one): compare the steps both logged.
    after = [s for s in cut if s > stopped and s in ref]
    assert after and all(cut[s] == ref[s] for s in after), {s: (cut[s], ref[s]) for s in after}


def ctrl_c(
    args: list[str], tmp: Path, after: str, again: float | None = None, wait: float = 0.0, launcher=TORCHRUN
) -> tuple[list[str], int]:
    """Launch, and ``wait`` s after a line starts with ``after`` press Ctrl-C (and again ``again`` s later):
    lines, status."""
    proc = subprocess.Popen(
        [*launcher, *args],
        cwd=tmp,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(after) and len([ln for ln in lines if ln.startswith(after)]) == 1:
            time.sleep(wait)
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
            if again is not None:
                time.sleep(again)
                os.killpg(proc.pid, signal.SIGINT)
    return lines, proc.wait(timeout=300)


@pytest.mark.slow  # make test-all: keeps make test near 10 minutes
@pytest.mark.timeout(400)
def test_a_second_ctrl_c_aborts_at_once_in_one_line(tmp_path):
    # Long steps (64 micro-steps, a few seconds here), so both presses fall inside step 3. The log line of
    # step 2 comes before that step's stop check, an all-reduce both ranks must reach: the first press
    # waits 0.5 s so that check is behind both ranks; the second comes past the 0.5 s in which a repeat
    # is taken for the same press (fsdp2kit.StopSignal's repeat_after).
    args = recipe_args(tmp_path, "abort", "--train.grad_accum", "64")
    start = time.monotonic()
    # Under fsdp2kit launch: after step 2's line, the recipe's two lines and nothing else (torchrun would add its
    # SignalException tracebacks and 5 log lines); status 130, a shell's for SIGINT.
    lines, code = ctrl_c(args, tmp_path, after="step 2 ", again=0.8, wait=0.5, launcher=LAUNCH)
    seconds = time.monotonic() - start
    out = "".join(lines)
    assert lines[[ln.startswith("step 2 ") for ln in lines].index(True) + 1 :] == [
        "SIGINT: stopping after this step and saving a checkpoint (Ctrl-C again to abort without saving)\n",
        "interrupted (Ctrl-C): aborted at once, nothing saved since the last checkpoint\n",
    ], out[-4000:]
    assert not (tmp_path / "abort" / "ckpt").exists() or not list((tmp_path / "abort" / "ckpt").glob("step_*"))
    assert code == 130 and seconds < 200, (code, seconds)


@pytest.mark.slow  # make test: tests/dist/test_diagnostics.py names both, without a recipe launch
@pytest.mark.timeout(600)
def test_a_skipped_micro_step_and_a_nan_are_named_by_the_recipe(tmp_path):
    """Each is one block from rank 0 ("training error: ..."), no traceback, and the launcher's one line."""
    desync = ["--train.grad_accum", "2", "--train.skip_micro_at", "3", "--train.check_every", "1"]
    args = recipe_args(tmp_path, "desync", *desync, "--train.timeout", "60", "--train.check_timeout", "30")
    code, out, seconds = run(args, tmp_path, launcher=LAUNCH, env=env())
    lines = out.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith("training error:")), None)
    assert code == 1 and at is not None, out[-4000:]
    assert lines[at : at + 3] == [
        "training error: rank 0: ranks disagree at a check at step 3.",
        "Diverged: rank 1.",
        "Where each rank is:",
    ], out[-4000:]
    assert lines[at + 3].startswith("  rank 0: step 3, micro-step 0 of 2, check") and "diverged" not in lines[at + 3]
    assert lines[at + 4].startswith("  rank 1: step 3, micro-step 1 of 2, check") and "<- diverged" in lines[at + 4]
    assert lines[at + 5 :] == [
        "Relaunch the same command to resume from the newest checkpoint.",
        "fsdp2kit launch: rank 0 exited with status 1",
    ], out[-4000:]
    assert "Traceback" not in out and "[rank" not in out, out[-4000:]
    assert seconds < 300, seconds  # the checks caught it at once, not a timeout

    # A learning rate that blows the weights up: the step and the module are named, once, from rank 0.
    args = recipe_args(tmp_path, "nan", "--train.lr", "1e30", "--train.warmup", "1")
    code, out, _ = run(args, tmp_path, launcher=LAUNCH, env=env())
    lines = out.splitlines()
    assert code == 1 and lines[-1] == "fsdp2kit launch: rank 0 exited with status 1", out[-4000:]
    assert lines[-2].startswith("training error: step ") and "the first module in backward order" in lines[-2]
    assert lines[-2].endswith(
        "Lower the learning rate, check the data of this step, or skip such steps (--train.on_nonfinite skip); "
        "relaunch the same command to resume from the newest checkpoint."
    ), lines[-2]
    assert out.count("training error:") == 1 and "Traceback" not in out, out[-4000:]
