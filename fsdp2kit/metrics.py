"""Throughput, model FLOPs, MFU, peak memory and JSONL logging.

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
import torch.nn as nn

__all__ = [
    "JsonlLogger",
    "Timer",
    "peak_flops",
    "peak_memory_bytes",
    "reset_peak_memory",
    "transformer_flops_per_token",
]

# Dense bf16 peak FLOP/s (without sparsity) by device name fragment; MFU is reported only for these.
_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower, and is matched by name below
    "H100 PCIe": 756e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "4090": 165e12,
}


def transformer_flops_per_token(model: nn.Module, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus attention's
    ``12 * layers * hidden * seq_len`` (the PaLM appendix formula). Embedding tables do no
    matmul, so they are not counted."""
    n = sum(p.numel() for p in model.parameters())
    n -= sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    return 6.0 * n + 12.0 * n_layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None when unknown (CPUs: MFU is not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [k for k in _PEAK_BF16 if k in name]
    return _PEAK_BF16[max(matches, key=len)] if matches else None


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
