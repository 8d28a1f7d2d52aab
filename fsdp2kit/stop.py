"""Stop signals (SIGTERM from a scheduler, Slurm's --signal, Ctrl-C) agreed on by all ranks at a step boundary."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["EXIT_PREEMPTED", "StopSignal", "parse_signals"]

# sysexits.h EX_TEMPFAIL, "a temporary failure; the user is invited to retry": a launcher can
# tell "stopped on a signal after saving, run me again" from a crash (1, or 128+N for a signal).
EXIT_PREEMPTED = 75


def parse_signals(names: str | Iterable[str | int | signal.Signals]) -> list[signal.Signals]:
    """``"SIGTERM,SIGUSR1"`` (or ``"TERM, USR1"``, numbers, a list) -> signals; unknown names are a ValueError."""
    out = []
    for item in names.split(",") if isinstance(names, str) else names:
        key = item.strip().upper() if isinstance(item, str) else str(int(item))
        if key == "":
            continue
        try:
            sig = signal.Signals(int(key)) if key.isdigit() else signal.Signals["SIG" + key.removeprefix("SIG")]
        except (KeyError, ValueError):
            raise ValueError(f"unknown signal {str(item).strip()!r} (e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be caught")
        out.append(sig)
    return out


class StopSignal(contextlib.AbstractContextManager):
    """Catch stop signals on any rank (the handler only sets a flag); `should_stop` makes it every rank's decision
    at a step boundary (README.md, "Long runs: ..."). After a first SIGINT (a Ctrl-C), any stop
    signal more than ``repeat_after`` seconds later puts the previous handlers back and raises `KeyboardInterrupt`
    (docs/long-runs.md, "Ctrl-C"). ``on_signal(sig)`` runs inside the handler on the first signal (keep it to an
    ``os.write``). Create it in the main thread; `close` (or the end of the ``with``) puts the handlers back.
    """

    def __init__(
        self,
        signals: str | Iterable[str | int | signal.Signals] = "SIGTERM,SIGUSR1,SIGINT",
        *,
        repeat_after: float = 0.5,
        on_signal: Callable[[signal.Signals], None] | None = None,
    ):
        self.repeat_after = repeat_after
        self.on_signal = on_signal
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.by_rank: int | None = None
        self.agreed_signal: signal.Signals | None = None
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal must be created in the main thread (Python delivers signals there)")
        self._previous = {sig: signal.signal(sig, self._handle) for sig in parse_signals(signals)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        if self.received is None:
            self.received, self.received_at = sig, now
            if self.on_signal is not None:
                self.on_signal(sig)
        elif self.received == signal.SIGINT and now - self.received_at > self.repeat_after:
            self.close()
            raise KeyboardInterrupt(f"{sig.name} after {self.received.name}: aborted")

    @property
    def requested(self) -> bool:
        """Whether this rank has received one of the signals (local; no communication)."""
        return self.received is not None

    def should_stop(self, device: torch.device | str = "cpu", group=None) -> bool:
        """Whether any rank has received a signal: the same answer on every rank. Collective: one all-reduce (MAX)
        of the highest rank that received one (plus one) and its signal, kept in `by_rank` and `agreed_signal`."""
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        flag = torch.tensor([rank + 1, int(self.received)] if self.requested else [0, 0], device=device)
        if dist.is_initialized():
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

    def close(self) -> None:
        """Put back the handlers that were installed before (where this object's handler is still the one installed)."""
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self.close()
