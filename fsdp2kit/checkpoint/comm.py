"""The checkpointer's own collectives: object gathers, agreement on errors, the group DCP runs on."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fsdp2kit.checkpoint.layout import CheckpointError

# DCP reports a failure on any rank as a CheckpointException, which derives from BaseException.
FAILURES = (Exception, CheckpointException)


class Comm:
    """The checkpointer's object collectives, and the group DCP coordinates on.

    Synchronous saves and loads use the default group: everything runs on the calling thread,
    between training steps. Asynchronous saves get a gloo group of their own: DCP's collectives
    then run on a background thread while training runs FSDP's on the default group, and one
    group used by two threads at once would interleave their messages. Gloo, because DCP
    exchanges only plans (Python objects) and async_save requires a CPU backend, so this also
    works when the default group is NCCL. It inherits the default group's timeout, so a dead
    rank becomes an error within that time, not a hang.
    """

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

    def gather(self, obj: Any, what: str, local_error: Any = None) -> list[Any]:
        """Every rank's ``obj``; a rank that died or timed out becomes a CheckpointError here."""
        if not self.active:
            return [obj]
        self.setup()
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:
            mine = f"; this rank's own error: {local_error}" if local_error else ""
            raise CheckpointError(
                f"{what}: lost contact with the other ranks (a rank died or timed out): {describe(e)}{mine}"
            ) from e
        return out

    def agree(self, problems: str | list[str] | None, what: str) -> None:
        """Raise the same CheckpointError on every rank if any rank has a problem."""
        raise_gathered(self.gather(problems, what, problems), what)


def _default_timeout():
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # private API moved: gloo's own default (30 minutes)
        return None


def describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def raise_gathered(replies: list[str | list[str] | None], what: str) -> None:
    """Raise one CheckpointError on every rank if any rank reported a problem."""
    by_message: dict[str, list[int]] = {}
    for rank, reply in enumerate(replies):
        for message in [reply] if isinstance(reply, str) else reply or []:
            by_message.setdefault(message, []).append(rank)
    if not by_message:
        return
    world = len(replies)
    parts = []
    for message, ranks in by_message.items():
        who = (
            "every rank"
            if len(ranks) == world and world > 1
            else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        )
        parts.append(f"[{who}] {message}")
    raise CheckpointError(f"{what}:\n  " + "\n  ".join(parts))


def quiet_without_process_group(active: bool) -> None:
    """Without a process group DCP works in-process but warns on every save and load that it
    assumes so, from its writer thread too, where no catch_warnings reaches. That is exactly
    what is meant here, so this one message is filtered (an identical filter replaces, not
    accumulates), and only once it can occur."""
    if not active:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
