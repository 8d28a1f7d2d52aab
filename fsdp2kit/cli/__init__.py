"""The ``fsdp2kit`` command line: one module per subcommand, whose ``add_<name>(subparsers)`` declares
its arguments and sets ``func`` to its ``run_<name>(args) -> int``; `SUBCOMMANDS` lists them."""

from __future__ import annotations

import argparse
import sys

from fsdp2kit.checkpoint import CheckpointError
from fsdp2kit.cli.convert_config import add_convert_config
from fsdp2kit.cli.export import add_export_hf
from fsdp2kit.cli.inspect import add_inspect
from fsdp2kit.cli.launch import add_launch, run_launch
from fsdp2kit.cli.plan import add_plan

__all__ = ["SUBCOMMANDS", "main"]


SUBCOMMANDS = [add_inspect, add_export_hf, add_plan, add_convert_config, add_launch]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp2kit", description="fsdp2kit: checkpoints, export, planning and launching for FSDP2."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fsdp2kit`` command; returns the exit status (0 ok, 1 error, 2 usage)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # torchrun's options and the script's own: torchrun's parser reads them
        return run_launch(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"fsdp2kit {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `fsdp2kit inspect ... | head`: the reader has what it wanted
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
