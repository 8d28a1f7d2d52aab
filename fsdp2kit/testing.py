"""Run a function on a real multi-process group (gloo on CPU, NCCL on GPUs), from a test or a notebook (how and why:
docs/internals.md, section fsdp2kit/testing.py)."""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp2kit.dist import init_distributed

__all__ = ["WorldError", "run_world"]


class WorldError(RuntimeError):
    """One or more ranks raised, or the world did not finish before its deadline."""


def _child(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, collective_timeout: float, device: str
):
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{k: str(v) for k, v in env.items()})
    # Several ranks share few cores: one thread each, as torchrun does, or they fight.
    torch.set_num_threads(1)
    try:
        init_distributed(timeout=collective_timeout, device=device)
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    grace: float = 10.0,
    device: str = "cpu",
) -> list[Any]:
    """Run ``fn(*args)`` (a module-level function) on ``world_size`` fresh processes, each after
    ``fsdp2kit.init_distributed()``: a gloo group, or with ``device="cuda"`` NCCL with a GPU a rank (return
    CPU values then). Returns the ranks' values in rank order; raises `WorldError` with every failed rank's
    traceback, or naming the ranks still running after ``timeout`` s. Once a rank failed, the rest get
    ``grace`` seconds before they are killed, so an error never turns into a hang.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"run_world: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"run_world: {world_size} ranks on device='cuda' need {world_size} GPUs, "
            f"this machine has {torch.cuda.device_count()}"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, timeout, device), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()

    reports: dict[int, tuple[bool, Any]] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < world_size and (remaining := deadline - time.monotonic()) > 0:
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
            reports[rank] = (ok, value)
        except queue_mod.Empty:
            # A rank killed by a signal never reports: after a moment for a report still in
            # flight, count it as failed rather than waiting for the deadline.
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in reports and p.exitcode is not None and now - exited_at.setdefault(r, now) > 2.0:
                    reports[r] = (False, f"process exited with code {p.exitcode} without reporting")
        if any(not ok for ok, _ in reports.values()):
            deadline = min(deadline, time.monotonic() + grace)

    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)

    hung = [r for r in range(world_size) if r not in reports]
    parts = [f"ranks {hung} did not finish within the deadline (killed)"] if hung else []
    parts += [f"--- rank {r} ---\n{tb}" for r, (ok, tb) in sorted(reports.items()) if not ok]
    if parts:
        raise WorldError("\n".join([f"{fn.__qualname__} on {world_size} ranks failed", *parts]))
    return [reports[r][1] for r in range(world_size)]
