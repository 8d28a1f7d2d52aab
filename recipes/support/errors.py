"""One error path for the recipes: a user's mistake is one short block from rank 0 and a non-zero exit.

A mistake in a config value, a command-line option, the data or the model directory raises
`UsageError` (or a subclass: `ConfigError`, `DataError`) wherever it is found; `run_recipe` catches
it once, at the top of the script. Rank 0 prints ``<kind> error: <what>, where, the fix`` and the
other ranks print nothing: no Python traceback for a mistake, unless ``--debug`` or
``FSDP2KIT_DEBUG=1`` asks for it. Most checks run before the process group starts, so the rank
comes from torchrun's environment (RANK), not from torch.distributed.

Under torchrun, the order in which the ranks exit decides what torchrun prints below the block:
a worker that exits non-zero while another is still alive gets that one SIGTERMed (possibly
before it has printed) and listed as a second failure. So the ranks meet in torchrun's own
key-value store (no process group): rank 0 prints, then waits until every other rank has left;
those leave with status 0 (local rank 0 of another node with 1, so every node's torchrun fails);
rank 0 leaves last with status 1, and torchrun reports one failure, rank 0's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NoReturn

__all__ = ["DEBUG_ENV", "ConfigError", "TrainingError", "UsageError", "debug_requested", "run_recipe"]

DEBUG_ENV = "FSDP2KIT_DEBUG"
# How long rank 0 waits for the others to report the same mistake (and they for rank 0). The ranks
# check the same config within seconds of each other; a rank that never arrives (it found no
# mistake, e.g. a file present on its node only) is left to torchrun once this has passed.
_MEET_SECONDS = 60.0


class UsageError(ValueError):
    """A mistake the user fixes in their config, command line, data or model directory: shown as one block."""

    kind = "config"

    def __init__(self, message: str, *, kind: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind

    def block(self) -> str:
        return f"{self.kind} error: {self}"


class ConfigError(UsageError):
    """A config value, from a TOML file or the command line."""

    kind = "config"


class TrainingError(UsageError):
    """Training stopped on a diagnosis (a non-finite step, ranks out of step): the diagnosis and how to go on."""

    kind = "training"

    def __init__(self, error: BaseException):
        from fsdp2kit.diagnostics import NonFiniteError

        fix = "; relaunch the same command to resume from the newest checkpoint"
        if isinstance(error, NonFiniteError):  # the library names its argument; the recipe's option is this one
            text = str(error).replace("(on_nonfinite='skip').", "(--train.on_nonfinite skip)") + fix + "."
        else:  # a DesyncError: its first line, where each rank is, then the way on
            text = f"{error}\nRelaunch the same command to resume from the newest checkpoint."
        super().__init__(text)
        # ranks whose process is gone: rank 0 does not wait for them to leave (see `leave`)
        self.gone = set(getattr(error, "gone", {}))


def debug_requested(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def run_recipe(main: Callable[[list[str]], None], argv: Sequence[str] | None = None) -> None:
    """``main(argv)``; a `UsageError`, or a diagnosis from fsdp2kit.diagnostics (`DesyncError`, `NonFiniteError`),
    becomes the one block (or, with --debug, its traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from fsdp2kit.diagnostics import DesyncError, NonFiniteError

    try:
        main(argv)
    except (UsageError, DesyncError, NonFiniteError) as e:
        if debug_requested(argv):
            raise
        leave(e if isinstance(e, UsageError) else TrainingError(e))


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _agent_store():
    """torchrun's key-value store (every worker is its client), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    try:
        import torch.distributed as dist

        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    except Exception:  # no store to meet in: every rank exits 1, rank 0 having printed
        return None


def leave(error: UsageError) -> NoReturn:
    """Print ``error`` on rank 0 only and exit; rank 0 exits last, with status 1 (see the module docstring)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    rank, local_rank, world = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0), _env_int("WORLD_SIZE", 1)
    store = _agent_store() if world > 1 else None
    key = f"fsdp2kit/usage_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        print(error.block(), file=sys.stderr, flush=True)
        if store is not None:
            store.set(f"{key}/said", "1")
            deadline = time.monotonic() + _MEET_SECONDS
            others = world - 1 - len(getattr(error, "gone", ()))  # a rank whose process is gone never leaves
            while store.add(f"{key}/left", 0) < others and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # the others announced, then exited at once: let torchrun see them gone
        sys.exit(1)
    if store is None:
        sys.exit(1)
    try:
        store.wait([f"{key}/said"], timedelta(seconds=_MEET_SECONDS))
    except Exception:  # rank 0 did not find this mistake: say it here, as no one else will
        print(f"rank {rank}: {error.block()}", file=sys.stderr, flush=True)
        sys.exit(1)
    store.add(f"{key}/left", 1)
    sys.stdout.flush()
    sys.stderr.flush()
    # At once (no interpreter teardown), so that this rank is gone before rank 0 exits.
    os._exit(1 if local_rank == 0 else 0)
