"""What a long run must not leak, read cheaply: resident memory now, open file descriptors, threads."""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["RESOURCE_KEYS", "process_resources"]

RESOURCE_KEYS = ("rss_mib", "open_fds", "py_threads", "os_threads")


def process_resources() -> list[float]:
    """[current RSS in MiB, open fds, Python threads, OS threads] of this process (Linux /proc; -1 elsewhere).

    The current resident set, not the high-water mark that `peak_memory_bytes` reports: growth
    after warm-up is what a leak looks like.
    """
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        rss = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
        fds = len(os.listdir("/proc/self/fd"))
        status = Path("/proc/self/status").read_text()
        os_threads = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
    except (OSError, StopIteration, ValueError):
        rss = fds = os_threads = -1
    return [rss, fds, threading.active_count(), os_threads]
