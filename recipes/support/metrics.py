"""The recipe's measurements: timing, peak memory and JSONL logging (FLOPs and MFU: `fsdp2kit.mfu`).

Peak memory is what the device reports, logged under a name that says which figure it is
(`peak_memory_key`): on CUDA the allocator's high-water mark (``torch.cuda.max_memory_allocated``,
``peak_alloc_gib``); on CPU the process's resident-set high-water mark (``ru_maxrss``,
``peak_rss_gib``), which includes the interpreter and libraries (~0.5 GiB with torch and
transformers imported), so compare CPU figures with each other, not with a GPU's.

RSS is not what `fsdp2kit.plan_memory` predicts on CPU (live tensor bytes), so on CPU
`LivePeak` also measures one step's peak of live tensor bytes with the planner's own tracker:
that one sits beside the prediction (``peak_live_gib`` vs ``predicted_peak_gib``).
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "JsonlLogger",
    "LivePeak",
    "Timer",
    "peak_memory_bytes",
    "peak_memory_key",
    "reset_peak_memory",
]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_key(device: torch.device) -> str:
    """The log key of `peak_memory_bytes` in GiB: ``peak_alloc_gib`` (CUDA) or ``peak_rss_gib`` (CPU)."""
    return "peak_alloc_gib" if device.type == "cuda" else "peak_rss_gib"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class LivePeak:
    """On CPU, one step's peak of live tensor bytes (what ``plan_memory`` predicts there), and its cost.

    RSS counts the interpreter, libraries and freed memory the allocator keeps; live tensor
    bytes count the parameters, gradients, optimizer state and every tensor alive at each op
    (`fsdp2kit.planner.live.LiveBytes`, which sums the live storages after every op, so the
    step it watches runs slower: ``seconds`` is that step's wall time, for comparison with
    the others). Only ``at_step`` is watched, the run's second step by default: the
    optimizer state exists by then, as the planner assumes. On CUDA nothing is done (the
    allocator's own peak is exact). Nor with torchao's optimizers (make_optimizer's low-bit and
    bf16 choices): their step is a ``torch.compile(fullgraph=True)`` function, which refuses to
    trace under the dispatch mode that counts the bytes; their state bytes are checked against
    the planner by tests/unit/test_optim_unit.py instead.
    """

    def __init__(self, device: torch.device, at_step: int):
        self.enabled = device.type == "cpu"
        self.at_step = at_step
        self.peak: int | None = None
        self.seconds = 0.0

    @contextlib.contextmanager
    def watch(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        if not self.enabled or step != self.at_step or type(optimizer).__module__ == "fsdp2kit.optim":
            yield
            return
        from fsdp2kit.planner.live import LiveBytes

        live = LiveBytes()
        live.track([*model.parameters(), *model.buffers()])
        live.track(v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        t0 = time.perf_counter()
        with live:
            yield
        self.seconds = time.perf_counter() - t0
        self.peak = live.peak


class Timer:
    """Wall time between marks, synchronising CUDA so the figure covers the work, not its launch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


class JsonlLogger:
    """Appends one JSON object per call; only the rank that creates it with ``enabled=True`` writes."""

    def __init__(self, path: str | Path | None, *, enabled: bool = True):
        self.path = Path(path) if path and enabled else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict[str, Any]) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
