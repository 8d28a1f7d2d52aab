"""Hangs and desyncs named: ranks compare positions at cheap checks and report where each rank is when one strays."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves

from fsdp2kit._internal.dtensor import fsdp_units
from fsdp2kit._internal.fmt import fmt_list

__all__ = ["PHASES", "DesyncError", "Position", "RankMonitor"]

# The unit phases are marked by hooks around FSDP's collectives and a unit's compute (they name the unit); the
# others are set by the training loop (`RankMonitor.phase`).
_UNIT_PHASES = ("all-gather", "forward", "backward all-gather", "backward", "reduce-scatter")
PHASES = ("start", "data", *_UNIT_PHASES, "optimizer", "check", "checkpoint", "eval", "step end")
_KEY = "fsdp2kit/monitor/"
_MICRO, _END = 1, 2  # check kinds
_DIMS = 4  # batch dimensions compared
_POLL = 0.25  # seconds between the watcher's looks for a request for positions


@dataclass
class Position:
    """Where a rank is in training (step, micro-step, FSDP unit, phase); `RankMonitor` keeps it current."""

    step: int = -1
    micro: int = -1  # the micro-step index the training loop gave
    micro_count: int = 0  # micro-steps this rank has begun in this step (counted, not given)
    last_count: int = -1  # micro-steps the previous step had (-1: no previous step in this process)
    phase: str = "start"
    unit: str = ""
    shape: tuple[int, ...] = ()
    since: float = 0.0  # when this phase began (time.time(): hosts compare with clock skew)

    def describe(self, micro_steps: int | None = None) -> str:
        if self.step < 0:
            return f"before the first step ({self.phase})"
        of = f" of {micro_steps}" if micro_steps else ""
        micro = f", micro-step {self.micro}{of}" if self.micro >= 0 else ""
        unit = f" {self.unit or '<root>'}" if self.phase in _UNIT_PHASES else ""
        tail = f", batch {list(self.shape)}" if self.shape else ""
        if self.micro >= 0 and self.micro_count != self.micro + 1:
            tail += f" (only {self.micro_count} micro-step{'s' if self.micro_count != 1 else ''} begun in this step)"
        if micro_steps and self.last_count >= 0 and self.last_count != micro_steps:
            tail += f" (its previous step had {self.last_count} micro-step{'s' if self.last_count != 1 else ''})"
        return f"step {self.step}{micro}, {self.phase}{unit}{tail}"


class DesyncError(RuntimeError):
    """Ranks are not at the same point of training (or one stopped answering); names the ones that diverged."""

    def __init__(self, message: str, *, diverged: list[int], positions: dict[int, Position], gone=None):
        super().__init__(message)
        self.diverged = diverged
        self.positions = positions
        self.gone: dict[int, str] = gone or {}  # how each gone rank's process ended, in words


class RankMonitor:
    """Track this rank's position, compare it with the other ranks' at cheap checks, report hangs.

    Per step: `step`, then inside `guard` one `micro_step` per micro-batch and `step_end`; `close` at the end
    (README.md, section Long runs, has the loop). Hooks on the FSDP units keep the position (`position`), a
    thread publishes it every ``heartbeat`` seconds.
    Every ``check_every`` steps, micro-step starts and the step end are compared across ranks (timeout
    ``timeout``); a mismatch, a timeout, or a collective failing inside `guard` raises a `DesyncError` that
    lists every rank's position and names the ranks that diverged or are gone (how: docs/long-runs.md).
    Creating it is collective (a gloo group); with no process group (or one rank), only the tracking is done.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        micro_steps: int | None = None,
        check_every: int = 1,
        timeout: float = 60.0,
        heartbeat: float = 2.0,
    ):
        if check_every < 0:
            raise ValueError(f"check_every must be >= 0 (0: never), got {check_every}")
        if timeout <= 0 or heartbeat <= 0:
            raise ValueError(f"timeout and heartbeat must be > 0 seconds, got {timeout} and {heartbeat}")
        self.position = Position(since=time.time())
        self._handles = []
        if model is not None:
            self.attach(model)
        self.micro_steps = micro_steps
        self.check_every = check_every
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.active = self.world > 1
        self._reported = False  # this rank raised or printed a report: print nothing more
        self._stop = threading.Event()
        self._thread = None
        if not self.active:
            return
        from torch.distributed.distributed_c10d import _get_default_store  # the group's own store (torchrun's)

        # Its own gloo group and timeout; its name (the same on every rank) keeps this monitor's keys apart
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self._store = dist.PrefixStore(f"{_KEY}{self._group.group_name}/", _get_default_store())
        self._store.set(f"who/{self.rank}", json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        self._publish()
        dist.barrier(group=self._group)  # every rank's first position is in the store before anyone reads
        self._thread = threading.Thread(target=self._watch, name="fsdp2kit-monitor", daemon=True)
        self._thread.start()

    def step(self, step: int) -> None:
        p = self.position
        p.last_count = p.micro_count if p.step >= 0 else -1
        p.step, p.micro, p.micro_count, p.shape = step, -1, 0, ()
        self._set("data", "")

    def micro_step(self, index: int, batch: torch.Tensor | None = None) -> None:
        p = self.position
        p.micro = index
        p.micro_count += 1
        p.shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else ()
        self._set("data", "")
        self._compare(_MICRO)

    def step_end(self) -> None:
        """The micro-steps of this step are done (call before clipping and the optimizer)."""
        self._set("step end", "")
        self._compare(_END)

    def phase(self, phase: str, unit: str = "") -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        self._set(phase, unit)

    def _set(self, phase: str, unit: str) -> None:
        p = self.position
        p.phase, p.unit, p.since = phase, unit, time.time()

    def attach(self, model: nn.Module) -> None:
        """Hook every FSDP unit of ``model`` (call after ``shard_model``); `detach` removes the hooks."""
        fsdp_units(model, type(self).__name__)  # a clear error when there are none
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                self._hook(name, module)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str, module: nn.Module) -> None:
        def mark_grad(tensors, phase: str) -> None:
            grads = (t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor) and t.requires_grad)
            if torch.is_grad_enabled() and (t := next(grads, None)) is not None:
                t.register_hook(lambda grad: self._set(phase, name))

        def after_fsdp(mod, args):
            self._set("forward", name)
            mark_grad(args, "reduce-scatter")  # the unit's backward is done when its input's gradient is

        self._handles += [
            # prepend=True and registered after fully_shard: runs before FSDP's own pre-forward hook.
            module.register_forward_pre_hook(lambda mod, args: self._set("all-gather", name), prepend=True),
            module.register_forward_pre_hook(after_fsdp),
            # Runs before FSDP's post-forward, so its gradient hook is registered (and runs) first.
            module.register_forward_hook(lambda mod, args, out: mark_grad(out, "backward all-gather"), prepend=True),
            module.register_forward_hook(lambda mod, args, out: mark_grad(out, "backward")),
        ]

    def _compare(self, kind: int) -> None:
        p = self.position
        if not (self.active and self.check_every > 0 and p.step % self.check_every == 0):
            return
        shape = list(p.shape[:_DIMS]) + [-1] * (_DIMS - len(p.shape[:_DIMS]))
        mine = torch.tensor([kind, p.step, p.micro, p.micro_count, p.last_count, *shape], dtype=torch.int64)
        if kind == _MICRO:
            self._set("check", "")
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(gathered, mine, group=self._group)
        except Exception as e:
            self._raise(f"ranks did not all reach the check within {self.timeout:g} s ({type(e).__name__})", e)
        rows = [tuple(g.tolist()) for g in gathered]
        if len(set(rows)) > 1:
            self._raise("ranks disagree at a check", None, rows=rows)
        if kind == _MICRO:
            self._set("data", "")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Inside it, a failed or timed-out collective becomes a `DesyncError` listing every rank's position."""
        try:
            yield
        except DesyncError:
            raise
        except Exception as e:
            # gloo reports a timeout or a lost peer as a plain RuntimeError
            text = str(e).lower()
            lost = isinstance(e, RuntimeError) and any(w in text for w in ("timed out", "timeout", "connection"))
            if self.active and (isinstance(e, dist.DistError) or lost):
                self._raise(f"a collective failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})", e)
            raise

    def _raise(self, what: str, cause: BaseException | None, rows: list[tuple] | None = None) -> None:
        self._reported = True
        self._publish()
        # Ask every rank's thread for its position now; wait 2 s for the answers (a gone rank's process never will)
        asked = self._store.add("ask", 1)
        answered, gone, deadline = {self.rank}, {}, time.monotonic() + 2.0
        while len(answered) + len(gone) < self.world and time.monotonic() <= deadline:
            for r in set(range(self.world)) - answered - set(gone):
                who = json.loads(self._store.get(f"who/{r}"))
                how = _process_end(int(who["pid"])) if who["host"] == socket.gethostname() else None
                if how is not None:
                    gone[r] = f"its process (pid {who['pid']}) {how}"
                elif self._store.check([f"ans/{r}"]) and int(self._store.get(f"ans/{r}")) >= asked:
                    answered.add(r)
            time.sleep(0.02)
        now = time.time()
        published = [json.loads(self._store.get(f"pos/{r}")) for r in range(self.world)]  # this rank's too
        at = [d.pop("at") for d in published]
        positions = {r: Position(**{**d, "shape": tuple(d["shape"])}) for r, d in enumerate(published)}
        # A gone rank is the one to name; else _blame's, by the check's rows (all of one moment) if there are some
        checked = [Position(*row[1:5], "check" if row[0] == _MICRO else "step end") for row in rows or ()]
        diverged = sorted(gone) or _blame(checked or list(positions.values()), self.micro_steps, rows)
        lines = [f"rank {self.rank}: {what} at step {self.position.step}."]
        lines += [f"Rank {r} is gone: {how}." for r, how in sorted(gone.items())]
        lines.append(
            f"Diverged: rank{'s' if len(diverged) > 1 else ''} {fmt_list(diverged)}."
            if diverged
            else "Which rank diverged cannot be told from the positions alone."
        )
        lines.append("Where each rank is:")
        for r, p in positions.items():
            where = p.describe(self.micro_steps)
            if r in gone or r not in answered:
                state = "gone" if r in gone else "no answer to a request for positions"
                where = f"{state}; its last position, published {now - at[r]:.1f} s before: {where}"
            else:
                where += f"  ({now - p.since:.1f} s in this phase)"
            lines.append(f"  rank {r}: {where}{'  <- diverged' if r in diverged else ''}")
        message = "\n".join(lines)
        with contextlib.suppress(Exception):
            self._store.set("report", message)
        raise DesyncError(message, diverged=diverged, positions=positions, gone=gone) from cause

    def _publish(self) -> None:
        self._store.set(f"pos/{self.rank}", json.dumps({**asdict(self.position), "at": time.time()}))

    def _watch(self) -> None:
        # Every `_POLL` s one integer read (is there a request for positions?); every heartbeat the
        # position, changed or not: its time stamp is this rank's sign of life.
        last_beat, answered = time.monotonic(), 0  # answered: the last request for positions this rank answered
        while not self._stop.wait(min(self.heartbeat, _POLL)):
            try:
                asked = self._store.add("ask", 0)
                if asked > answered or time.monotonic() - last_beat >= self.heartbeat:
                    self._publish()
                    last_beat = time.monotonic()
                if asked > answered:
                    answered = asked
                    self._store.set(f"ans/{self.rank}", str(asked))
                if not self._reported and asked and self._store.check(["report"]):
                    self._reported = True
                    report = self._store.get("report").decode()
                    print(
                        f"[fsdp2kit rank {self.rank}] another rank reported a desync; this rank is at "
                        f"{self.position.describe(self.micro_steps)}.\n{report}",
                        file=sys.stderr,
                        flush=True,
                    )
            except Exception:
                return  # the store is gone (the job is ending): nothing left to watch

    def close(self) -> None:
        """Stop the thread and remove the hooks (the gloo group goes with the process group)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat + 5)
        self.detach()


def _blame(positions: list[Position], micro_steps: int | None, keys: list | None = None) -> list[int]:
    """The ranks whose counts contradict the loop, else the minority of the check's rows or positions (a tie: none)."""

    def wrong(count: int) -> bool:  # `micro_count` includes the current micro-step: index i is the (i+1)-th
        return bool(micro_steps) and count >= 0 and count != micro_steps

    bad = [
        r
        for r, p in enumerate(positions)
        if (p.micro >= 0 and p.micro_count != p.micro + 1)
        or (p.phase == "step end" and wrong(p.micro_count))
        or wrong(p.last_count)
    ]
    if bad:
        return bad
    rows = keys or [(p.step, p.micro_count, p.phase == "check") for p in positions]
    (top, n), *rest = Counter(rows).most_common()
    return [] if rest and rest[0][1] == n else [r for r, row in enumerate(rows) if row != top]


def _process_end(pid: int) -> str | None:
    """How process ``pid`` (on this host) ended, in words, or None while it runs."""
    try:
        os.kill(pid, 0)  # a zombie still takes signals
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except ProcessLookupError:
        return "has exited"
    except OSError:  # another user's process, or no /proc: not known to have ended
        return None
    if fields[0] != "Z":
        return None
    code = int(fields[49])  # field 52, a wait status: the signal in the low 7 bits, else the exit status above them
    if sig := code & 0x7F:
        return f"was killed by {signal.Signals(sig).name if sig in set(signal.Signals) else f'signal {sig}'}"
    return f"has exited with status {code >> 8}"
