"""The recipe's measurements: timing, peak memory and JSONL logging (FLOPs and MFU: `fsdp2kit.mfu`).

Peak memory is what the device reports: on CUDA the allocator's high-water mark
(``torch.cuda.max_memory_allocated``); on CPU the process's resident-set high-water mark
(``ru_maxrss``), which includes the interpreter and libraries (~0.5 GiB with torch and
transformers imported), so compare CPU figures with each other, not with a GPU's.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "JsonlLogger",
    "Timer",
    "peak_memory_bytes",
    "reset_peak_memory",
]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


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
