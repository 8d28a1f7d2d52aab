"""The recipe's orderly stop on a signal: checkpoint, requeue under Slurm, exit with the "run me again" status.

Ctrl-C is a stop too: the first one saves at the step boundary and exits 0 with the command's way
back; a second one aborts at once with one line and status 130 (see `fsdp2kit.StopSignal`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import torch.distributed as dist

from fsdp2kit.stop import EXIT_PREEMPTED

__all__ = ["EXIT_INTERRUPTED", "EXIT_PREEMPTED", "abort_quietly", "announce_stop", "requeue_slurm", "stop_after_signal"]

# 128 + SIGINT, what a shell reports for a command ended by Ctrl-C.
EXIT_INTERRUPTED = 130


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
    if stop.agreed_signal == signal.SIGINT:
        # Ctrl-C: the user asked for the stop, so no requeue and status 0; the way back is the same command.
        if is_main:
            print(
                f"stopped at step {done} by SIGINT (Ctrl-C); checkpoint {ck.root.resolve()}/step_{done:08d}; "
                "relaunch the same command to resume",
                flush=True,
            )
        dist.destroy_process_group()
        sys.exit(0)
    if is_main:
        note = requeue_slurm() if requeue else "requeue off"
        print(
            f"preempted: {stop.describe()}; every rank stopped after step {done}, checkpoint "
            f"{ck.root.resolve()}/step_{done:08d} saved; {note}; exiting with status {EXIT_PREEMPTED}",
            flush=True,
        )
    dist.destroy_process_group()
    sys.exit(EXIT_PREEMPTED)


def announce_stop(sig: signal.Signals) -> None:
    """`StopSignal`'s ``on_signal`` on rank 0: say at once that the stop is coming (a step may be long).

    It runs inside the signal handler, so it writes with one ``os.write``: a ``print`` there could
    interrupt another ``print`` on the same stream.
    """
    again = " (Ctrl-C again to abort without saving)" if sig == signal.SIGINT else ""
    os.write(2, f"{sig.name}: stopping after this step and saving a checkpoint{again}\n".encode())


@contextlib.contextmanager
def abort_quietly() -> Iterator[None]:
    """Around the recipe's main: a `KeyboardInterrupt` (a second Ctrl-C, or one before training) exits at once.

    One line on rank 0, status 130.

    ``os._exit``: no interpreter teardown, which would wait on (or abort in) the process group's
    threads; nothing is saved, which is what a second Ctrl-C asks for.
    """
    try:
        yield
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            os.write(2, b"interrupted (Ctrl-C): aborted at once, nothing saved since the last checkpoint\n")
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)
