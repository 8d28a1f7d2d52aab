"""The recipe's orderly stop on a signal: checkpoint, requeue under Slurm, exit with the "run me again" status."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch.distributed as dist

from fsdp2kit.stop import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "requeue_slurm", "stop_after_signal"]


def requeue_slurm() -> str:
    """``scontrol requeue $SLURM_JOB_ID`` when running under Slurm with scontrol on PATH; what happened, in words."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not a Slurm job: not requeued"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"Slurm job {job}, but scontrol is not on PATH: not requeued"
    proc = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return f"scontrol requeue {job} failed ({proc.returncode}): {(proc.stdout + proc.stderr).strip()[:300]}"
    return f"Slurm job {job} requeued"


def stop_after_signal(ck, done: int, model, optimizer, extra: dict, *, saved: bool, stop, is_main: bool, requeue: bool):
    """Every rank: save step ``done`` (unless ``saved``: just saved), wait, requeue (rank 0), exit `EXIT_PREEMPTED`.

    ``saved`` must be the same on every rank (the loop's own schedule, not a look at the disk,
    which ranks could see differently): the save is collective.
    """
    if not saved:
        ck.save(done, model, optimizer=optimizer, extra=extra)
    ck.wait()
    if is_main:
        note = requeue_slurm() if requeue else "requeue off"
        print(
            f"preempted: {stop.describe()}; every rank stopped after step {done}, checkpoint "
            f"{ck.root.resolve()}/step_{done:08d} saved; {note}; exiting with status {EXIT_PREEMPTED}",
            flush=True,
        )
    dist.destroy_process_group()
    sys.exit(EXIT_PREEMPTED)
