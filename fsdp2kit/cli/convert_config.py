"""`fsdp2kit convert-config`: an Accelerate YAML or DeepSpeed JSON as a recipe TOML, every key accounted for."""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp2kit.migrate import convert_config


def add_convert_config(subparsers) -> None:
    p = subparsers.add_parser(
        "convert-config",
        help="an Accelerate YAML or DeepSpeed JSON config as a recipe TOML (stdout) and its torchrun command",
        description="Convert FILE (`accelerate config` YAML, or a DeepSpeed ZeRO JSON) into a TOML config for "
        "recipes/train.py. Every key of FILE is accounted for in the TOML: mapped (quoted on the line it sets), "
        "sent to the torchrun command, not needed under FSDP2 (with the reason) or refused (with what to use "
        "instead). A refused key makes the command fail (exit 1) unless --allow-refused. The torchrun command "
        "is printed on stderr. docs/migrating.md has the tables.",
    )
    p.add_argument("file", help="an `accelerate config` YAML (or JSON), or a DeepSpeed config JSON")
    p.add_argument("--source", choices=["accelerate", "deepspeed"], help="default: .json is DeepSpeed")
    p.add_argument("-o", "--output", help="write the TOML here instead of stdout")
    p.add_argument(
        "--allow-refused", action="store_true", help="write the TOML anyway, refused keys listed in its header"
    )
    p.set_defaults(func=run_convert_config)


def run_convert_config(args) -> int:
    conv = convert_config(args.file, source=args.source)
    config_name = args.output or f"{Path(args.file).stem}.toml"
    if conv.refused and not args.allow_refused:
        print(f"fsdp2kit convert-config: {len(conv.refused)} key(s) of {args.file} have no FSDP2 counterpart:",
              file=sys.stderr)  # fmt: skip
        for e in conv.refused:
            print(f"  {e.key} = {e.value!r}: {e.note}", file=sys.stderr)
        print("Change them in the file, or pass --allow-refused to write the TOML with them listed.", file=sys.stderr)
        return 1
    text = conv.to_toml(config_name)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(f"run: {conv.command(config_name)}", file=sys.stderr)
    return 0
