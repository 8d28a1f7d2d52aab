"""How a save drives DCP: the file writer's options, and a save planner that reuses its plan between saves.

Each choice (one file and one writer thread per rank, CRC-32 kept, plan caching) and what it
measured: docs/checkpoint-format.md ("Writing"). DCP keys its plan cache by name in class-level
dicts; each Checkpointer gets a key of its own, so two never share a cached plan, and
`forget_plans` frees it on close.
"""

from __future__ import annotations

import os
import uuid

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

__all__ = ["WRITER_THREADS", "ReusingSavePlanner", "forget_plans", "new_plan_key", "writer"]

WRITER_THREADS = 1


def writer(path: str | os.PathLike) -> FileSystemWriter:
    """DCP's file writer for one step's temporary directory: fsynced files, never overwriting."""
    return FileSystemWriter(
        path, sync_files=True, overwrite=False, single_file_per_rank=True, thread_count=WRITER_THREADS
    )


def new_plan_key() -> str:
    return f"fsdp2kit.Checkpointer-{uuid.uuid4().hex}"


class ReusingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with plan caching, under a cache key of the caller's."""

    def __init__(self, plan_key: str):
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = plan_key


def forget_plans(plan_key: str) -> None:
    """Drop everything DCP cached under ``plan_key`` (the plans of one Checkpointer)."""
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_final_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
    ):
        cache.pop(plan_key, None)
