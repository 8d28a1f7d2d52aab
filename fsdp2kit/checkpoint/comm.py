"""The checkpointer's collectives: agreement on errors, the group DCP runs on, DCP's single-process warning."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fsdp2kit._internal.agree import agree
from fsdp2kit.checkpoint.layout import CheckpointError

# DCP reports a failure on any rank as a CheckpointException, which derives from BaseException.
FAILURES = (Exception, CheckpointException)


class Comm:
    """The group the checkpointer agrees and DCP coordinates on: the default group, or for asynchronous
    saves a gloo group of their own (DCP then runs on the writer thread beside training), with the
    default group's timeout, so that a dead rank is an error, not a hang."""

    def __init__(self, own_group: bool) -> None:
        self.own_group = own_group
        self.group = None
        self._ready = False

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.active else 0

    @property
    def world(self) -> int:
        return dist.get_world_size() if self.active else 1

    def setup(self) -> None:
        """Collective the first time (it may create a group): every rank calls it at the same point."""
        if self.active and not self._ready:
            if self.own_group:
                self.group = dist.new_group(backend="gloo", timeout=_default_timeout())
            self._ready = True

    def agree(self, problems: str | list[str] | None, what: str, value: Any = None) -> list[Any]:
        """Every rank's ``value``; the same CheckpointError on every rank if any rank has a problem
        (`fsdp2kit._internal.agree.agree` on this group)."""
        self.setup()
        return agree(problems, what, value=value, groups=(self.group,), error_type=CheckpointError)


def _default_timeout():
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # private API moved: gloo's own default (30 minutes)
        return None


def describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def quiet_dcp(without_process_group: bool) -> Iterator[None]:
    """DCP's warning that a save or load without a process group assumes one process (meant here) ignored,
    only where DCP would warn: ``catch_warnings`` swaps the process-wide filters, which threads race on."""
    if not without_process_group:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
