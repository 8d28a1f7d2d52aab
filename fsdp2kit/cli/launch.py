"""`fsdp2kit launch`: torchrun, with its ending on a failed worker or Ctrl-C as one line (README.md, "Command line")."""

from __future__ import annotations

import logging
import os
import signal
import sys

__all__ = ["add_launch", "run_launch"]

# torchrun's log records that the line printed here replaces (logger name -> message formats).
_REPLACED = {
    "torch.distributed.elastic.multiprocessing.api": (
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        "Sending process %s closing signal %s",
    ),
    "torch.distributed.elastic.agent.server.api": ("Received %s death signal, shutting down workers",),
}


def add_launch(subparsers) -> None:
    # Listed for `fsdp2kit --help` only: `main` hands `launch ...` to torchrun's own parser before its own runs.
    subparsers.add_parser(
        "launch",
        add_help=False,
        help="torchrun without torchrun's traceback: fsdp2kit launch [torchrun options] SCRIPT [script args]",
    )


def _describe(rank: int, exitcode: int) -> str:
    if exitcode >= 0:
        return f"rank {rank} exited with status {exitcode}"
    name = {s.value: s.name for s in signal.Signals}.get(-exitcode, f"signal {-exitcode}")
    return f"rank {rank} killed by {name}"


def run_launch(argv: list[str]) -> int:
    """``torchrun ARGV``; returns the exit status of the first worker that failed (0 when none did)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "fsdp2kit launch"
    args = parser.parse_args(argv)
    if os.environ.get("FSDP2KIT_DEBUG", "").lower() not in ("", "0", "false", "no"):
        run(args)
        return 0
    # logging takes a plain callable as a filter: it drops the records whose format is one of those replaced
    drop = [(logging.getLogger(name), lambda r, f=formats: r.msg not in f) for name, formats in _REPLACED.items()]
    for logger, f in drop:
        logger.addFilter(f)
    try:
        run(args)
        return 0
    except ChildFailedError as e:
        # In the order they ended: the first is the cause, later ones are often torchrun's SIGTERM to the rest
        # (timestamps are whole seconds: within one, a SIGTERM comes after any other ending).
        sigterm = -int(signal.SIGTERM)
        failed = sorted(e.failures.items(), key=lambda i: (i[1].timestamp, i[1].exitcode == sigterm, i[0]))
        failure = failed[0][1]
        failed = ", then ".join(_describe(rank, f.exitcode) for rank, f in failed)
        print(f"fsdp2kit launch: {failed}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode
    except (SignalException, KeyboardInterrupt) as e:
        # torchrun has passed the signal on to the workers and waited for them (they save at the step boundary).
        return 128 + int(getattr(e, "sigval", signal.SIGINT))
    finally:
        for logger, f in drop:
            logger.removeFilter(f)
