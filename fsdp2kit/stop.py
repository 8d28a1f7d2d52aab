"""Stop signals (a scheduler's SIGTERM, Slurm's --signal) turned into one stop all ranks agree on at a step boundary."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["EXIT_PREEMPTED", "StopSignal", "parse_signals"]

# sysexits.h EX_TEMPFAIL, "a temporary failure; the user is invited to retry": a launcher can
# tell "stopped on a signal after saving, run me again" from a crash (1, or 128+N for a signal).
EXIT_PREEMPTED = 75


def parse_signals(names: str | Iterable[str | int | signal.Signals]) -> list[signal.Signals]:
    """``"SIGTERM,SIGUSR1"`` (or ``"TERM, USR1"``, numbers, a list) -> signals; unknown names are a ValueError."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out = []
    for item in items:
        if isinstance(item, str):
            name = item.strip().upper()
            if not name:
                continue
            if name.isdigit():
                item = int(name)
            else:
                name = name if name.startswith("SIG") else "SIG" + name
                if not hasattr(signal.Signals, name):
                    raise ValueError(f"unknown signal {item.strip()!r} (e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT)")
                item = signal.Signals[name]
        try:
            sig = signal.Signals(item)
        except ValueError:
            raise ValueError(f"unknown signal number {item!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be caught")
        out.append(sig)
    return out


class StopSignal:
    """Catch stop signals on any rank; `should_stop` makes it every rank's decision at a step boundary.

    ::

        stop = fk.StopSignal("SIGTERM,SIGUSR1")      # installs the handlers (main thread)
        for step in ...:
            train_one_step()
            if stop.should_stop():                   # collective: one tiny all-reduce
                ck.save(step, model, optimizer=opt)  # every rank saves the same step
                sys.exit(fk.EXIT_PREEMPTED)

    A scheduler may deliver the signal to one process only (a node's ranks, or just the one it
    picked); the handler only sets a flag, so the current step finishes untouched, and the flag
    reaches the other ranks through one all-reduce (MAX over one int) at the next boundary. Every
    rank then stops after the same step and can save a complete checkpoint. The previous
    handlers come back with `restore` (or when used as a context manager).
    """

    def __init__(self, signals: str | Iterable[str | int | signal.Signals] = "SIGTERM,SIGUSR1"):
        self.signals = parse_signals(signals)
        self.received: signal.Signals | None = None
        self.by_rank: int | None = None
        self.agreed_signal: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal must be created in the main thread (Python delivers signals there)")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """Whether this rank has received one of the signals (local; no communication)."""
        return self.received is not None

    def should_stop(self, device: torch.device | str = "cpu", group=None) -> bool:
        """Whether any rank has received a signal: the same answer on every rank. Collective.

        One all-reduce (MAX) of two integers: the highest rank that received a signal (plus one)
        and that signal's number, kept in `by_rank` and `agreed_signal` for the log.
        """
        if not dist.is_initialized():
            self.by_rank = 0 if self.requested else None
            self.agreed_signal = self.received
            return self.requested
        rank = dist.get_rank(group)
        mine = [rank + 1, int(self.received)] if self.requested else [0, 0]
        flag = torch.tensor(mine, dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        by, sig = flag.tolist()
        self.by_rank = by - 1 if by else None
        self.agreed_signal = signal.Signals(sig) if sig else None
        return by > 0

    def describe(self) -> str:
        """After `should_stop` said yes: which signal reached which rank, in words."""
        if self.by_rank is None:
            return "no stop signal"
        name = self.agreed_signal.name if self.agreed_signal else "a signal"
        return f"{name} reached rank {self.by_rank}" + (" (at least)" if dist.is_initialized() else "")

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
