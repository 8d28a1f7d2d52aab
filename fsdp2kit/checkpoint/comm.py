"""The checkpointer's collectives: its group, failures and DCP's single-process warning."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fsdp2kit.checkpoint.layout import CheckpointError

# DCP reports a failure on any rank as a CheckpointException, which derives from BaseException.
FAILURES = (Exception, CheckpointException)


def rank_world() -> tuple[int, int]:
    """This rank and the world size, (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if active() else (0, 1)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def new_group():
    """A gloo group of the checkpointer's own (asynchronous saves run DCP on it beside training), with
    the default group's timeout, so that a dead rank is an error, not a hang."""
    try:
        timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # private API moved: gloo's own default (30 minutes)
        timeout = None
    return dist.new_group(backend="gloo", timeout=timeout)


def describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def quiet_dcp(without_process_group: bool) -> Iterator[None]:
    """DCP's warning that a save or load without a process group assumes one process (meant here) ignored,
    only where DCP would warn: ``catch_warnings`` swaps the process-wide filters, which threads race on."""
    with warnings.catch_warnings() if without_process_group else contextlib.nullcontext():
        if without_process_group:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
