"""What every benchmark records beside its figures: the machine, its load, and a process's resident memory.

Results name the machine they were measured on (a ratio from a 2-core VM and one from 8 GPUs are
different results) and the load average while measuring, since this machine is shared. Resident
memory is read from /proc (Linux): the high-water mark ``VmHWM`` can be reset to the current
resident set by writing 5 to ``/proc/self/clear_refs``, which is what makes a per-phase peak
measurable without a tracker in the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

__all__ = ["cpu_name", "machine", "reset_rss_peak", "rss", "rss_peak"]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_total() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    return "?"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine(device: torch.device | None = None, world_size: int = 1) -> dict:
    """The machine and software a result was measured with, and a short slug for file names.

    ``description`` reads "AMD EPYC ..., 2 cores, 2 ranks x 1 thread(s)" on CPU and "8x NVIDIA
    H100 ..." on GPUs; ``slug`` is the same as a file-name fragment ("cpu-amd-epyc-...-2c-w2").
    """
    device = device or torch.device("cpu")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        description = f"{world_size}x {name}"
        slug = re.sub(r"[^a-z0-9]+", "-", f"cuda-{name}".lower()).strip("-")
    else:
        name = cpu_name()
        description = f"{name}, {os.cpu_count()} cores, {world_size} ranks x {torch.get_num_threads()} thread(s)"
        slug = re.sub(r"[^a-z0-9]+", "-", f"cpu-{name}-{os.cpu_count()}c".lower()).strip("-")
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for package in ("transformers", "torchao"):
        with contextlib.suppress(ImportError):
            versions[package] = __import__(package).__version__
    return {
        "description": description,
        "slug": f"{slug}-w{world_size}",
        "device": device.type,
        "cpu": cpu_name(),
        "nproc": os.cpu_count(),
        "memory": _memory_total(),
        "host": platform.node(),
        "uname": " ".join(platform.uname()),
        "threads_per_rank": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "uptime": _uptime(),
        **versions,
    }


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss() -> int:
    """This process's resident set, in bytes."""
    return _status("VmRSS")


def rss_peak() -> int:
    """This process's resident-set high-water mark since the last `reset_rss_peak`, in bytes."""
    return _status("VmHWM")


def reset_rss_peak() -> int | None:
    """Start a new resident-set peak from the current resident set, which is returned.

    Freed memory is handed back to the system first (garbage collection, ``malloc_trim``), so
    the next phase's peak is not hidden by pages an earlier phase left mapped. Returns None
    where the kernel offers no reset (not Linux).
    """
    if not Path("/proc/self/clear_refs").exists():
        return None
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return rss()
