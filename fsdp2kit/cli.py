"""The ``fsdp2kit`` command line.

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its arguments and sets
``func`` to a ``_run_<name>(args) -> int`` function; `SUBCOMMANDS` lists them. Adding a command
means writing those two functions and appending one entry.

    fsdp2kit inspect CKPT_DIR [--step N] [--json]
    fsdp2kit export-hf CKPT_DIR OUT_DIR [--step N] [--dtype bf16] [--config DIR] [--max-shard-size 5GB]
    fsdp2kit plan MODEL --shard N [--replicate M] [--strategy S] [--mixed-precision bf16] [--cpu-offload]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsdp2kit.plan import fmt_bytes

__all__ = ["SUBCOMMANDS", "main"]


# ---- inspect -----------------------------------------------------------------------------------


def describe_step(path: Path) -> dict:
    """What a step directory holds, from DCP metadata alone: no process group, no tensor read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdp2kit.checkpoint import INFO_FILE, read_metadata

    metadata = read_metadata(path)
    stored: dict[str, int] = {}
    if isinstance(metadata.storage_data, dict):
        for index, info in metadata.storage_data.items():
            stored[index.fqn] = stored.get(index.fqn, 0) + getattr(info, "length", 0)
    entries = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for d in md.size:
                numel *= d
            dtype = md.properties.dtype
            entries.append(
                {
                    "key": key,
                    "shape": list(md.size),
                    "dtype": str(dtype).removeprefix("torch."),
                    "numel": numel,
                    "bytes": numel * dtype.itemsize,
                }
            )
        else:  # a small pickled value (an optimizer hyper-parameter): its size on disk
            entries.append({"key": key, "shape": None, "dtype": "object", "numel": None, "bytes": stored.get(key, 0)})
    info_file = path / INFO_FILE
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    files = sorted(p for p in path.iterdir() if p.suffix == ".distcp")
    return {
        "path": str(path),
        "info": info,
        "has_hf_config": (path / "config.json").is_file(),
        "data_files": len(files),
        "data_bytes": sum(p.stat().st_size for p in files),
        "entries": entries,
    }


def inspect(ckpt_dir: str | Path, step: int | None = None) -> dict:
    """A checkpoint root's steps (complete and incomplete) and one step's contents.

    ``ckpt_dir`` may also be a single step directory (one holding ``.metadata``).
    """
    from fsdp2kit.checkpoint import CheckpointError, incomplete_dirs, list_steps, step_dir

    root = Path(ckpt_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    if (root / ".metadata").is_file():  # a step directory itself
        return {
            "root": str(root.parent),
            "steps": None,
            "incomplete": [],
            "step": None,
            "contents": describe_step(root),
        }
    steps = list_steps(root)
    report = {
        "root": str(root),
        "steps": steps,
        "incomplete": [p.name for p in incomplete_dirs(root)],
        "step": None,
        "contents": None,
    }
    if step is not None and step not in steps:
        raise CheckpointError(f"step {step} is not a complete step in {root}; complete steps: {steps or 'none'}")
    chosen = step if step is not None else (steps[-1] if steps else None)
    if chosen is not None:
        report["step"] = chosen
        report["contents"] = describe_step(step_dir(root, chosen))
    return report


def _print_inspect(report: dict, out) -> None:
    if report["steps"] is not None:
        print(f"checkpoint root: {report['root']}", file=out)
        print(f"complete steps: {', '.join(map(str, report['steps'])) or 'none'}", file=out)
        for name in report["incomplete"]:
            print(f"incomplete (ignored): {name}", file=out)
    contents = report["contents"]
    if contents is None:
        return
    info = contents["info"]
    print(f"\nstep {info.get('step', report['step'])}: {contents['path']}", file=out)
    if info:
        extras = ", ".join(info.get("extra", [])) or "none"
        per_rank = info.get("extra_per_rank", []) + (["rng"] if info.get("rng") else [])
        print(
            f"  saved {info.get('saved_at', '?')} by {info.get('world_size', '?')} rank(s), "
            f"torch {info.get('torch', '?')}, "
            f"optimizer {info.get('optimizer') or 'none'}",
            file=out,
        )
        print(f"  extra: {extras}; per rank: {', '.join(per_rank) or 'none'}", file=out)
    hf = ", Hugging Face config.json" if contents["has_hf_config"] else ""
    print(f"  {contents['data_files']} data file(s), {fmt_bytes(contents['data_bytes'])} on disk{hf}", file=out)

    groups: dict[str, list[dict]] = {}
    for e in contents["entries"]:
        groups.setdefault(e["key"].split(".", 1)[0], []).append(e)
    for group, entries in groups.items():
        tensors = [e for e in entries if e["shape"] is not None]
        numel = sum(e["numel"] for e in tensors)
        print(
            f"  {group:<10} {len(tensors):>5} tensor(s), {numel:,} elements, "
            f"{fmt_bytes(sum(e['bytes'] for e in tensors))}"
            + (f"; {len(entries) - len(tensors)} other value(s)" if len(entries) > len(tensors) else ""),
            file=out,
        )
    width = max(len(e["key"]) for e in contents["entries"]) if contents["entries"] else 3
    print(f"\n{'key':<{width}}  {'shape':<16} {'dtype':<9} size", file=out)
    for e in contents["entries"]:
        shape = "-" if e["shape"] is None else "(" + ", ".join(map(str, e["shape"])) + ")"
        print(f"{e['key']:<{width}}  {shape:<16} {e['dtype']:<9} {fmt_bytes(e['bytes'])}", file=out)


def _add_inspect(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="list a checkpoint's steps and one step's keys, shapes, dtypes and sizes",
        description="List the steps under CKPT_DIR (complete and incomplete) and, for the newest complete "
        "step or --step, every key with its shape, dtype and size. Reads DCP metadata only.",
    )
    p.add_argument("ckpt_dir", help="a Checkpointer root, or one step directory")
    p.add_argument("--step", type=int, default=None, help="the step to describe (default: the newest complete one)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.set_defaults(func=_run_inspect)


def _run_inspect(args) -> int:
    report = inspect(args.ckpt_dir, args.step)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        _print_inspect(report, sys.stdout)
    return 0


# ---- export-hf ---------------------------------------------------------------------------------

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _add_export_hf(subparsers) -> None:
    p = subparsers.add_parser(
        "export-hf",
        help="convert a checkpoint to Hugging Face safetensors that from_pretrained loads",
        description="Convert the newest complete step under CKPT_DIR (or --step, or CKPT_DIR as a step "
        "directory) to consolidated safetensors plus config in OUT_DIR, in one process, with the model's "
        "usual Hugging Face layout. Nothing is unpickled beyond DCP's tensor descriptions.",
    )
    p.add_argument("ckpt_dir", help="a Checkpointer root, or one step directory")
    p.add_argument("out_dir", help="where to write model*.safetensors and config.json")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the newest complete one)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast on export (default: as saved)")
    p.add_argument("--config", default=None, help="a Hugging Face config directory, when the step has no config.json")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    p.set_defaults(func=_run_export_hf)


def _run_export_hf(args) -> int:
    import torch

    from fsdp2kit.checkpoint import CheckpointError, list_steps, step_dir
    from fsdp2kit.convert import dcp_to_hf

    source = Path(args.ckpt_dir)
    if args.step is not None:
        if args.step not in list_steps(source):
            raise CheckpointError(
                f"step {args.step} is not a complete step in {source}; complete steps: {list_steps(source) or 'none'}"
            )
        source = step_dir(source, args.step)
    config = None
    if args.config:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.config, local_files_only=True)
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    out = dcp_to_hf(
        source, args.out_dir, config=config, dtype=dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite
    )
    print(f"wrote {out}")
    return 0


# ---- plan ----------------------------------------------------------------------------------------


def _add_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="what each rank would hold for a model on a mesh, without a GPU",
        description="Build MODEL (a named config such as llama3-8b, or a local Hugging Face directory) on the "
        "meta device and print the ShardPlan shard_model would produce on a (replicate x shard) mesh.",
    )
    p.add_argument("model", help="a named config (see fsdp2kit.models.NAMED_CONFIGS) or a local HF directory")
    p.add_argument("--shard", type=int, required=True, help="ranks that shard the model (e.g. GPUs per node)")
    p.add_argument("--replicate", type=int, default=1, help="replica groups (HSDP when > 1)")
    p.add_argument(
        "--strategy", default=None, help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2"
    )
    p.add_argument("--mixed-precision", default=None, help="fp32, bf16 or fp16")
    p.add_argument("--cpu-offload", action="store_true")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    from fsdp2kit.models import build_causal_lm
    from fsdp2kit.shard import estimate_plan

    model = build_causal_lm(args.model, meta=True)
    print(
        estimate_plan(
            model,
            shard=args.shard,
            replicate=args.replicate,
            strategy=args.strategy,
            mixed_precision=args.mixed_precision,
            cpu_offload=args.cpu_offload,
        )
    )
    return 0


# ---- wiring ------------------------------------------------------------------------------------

SUBCOMMANDS = [_add_inspect, _add_export_hf, _add_plan]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp2kit", description="fsdp2kit: checkpoints, export and planning for FSDP2."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fsdp2kit`` command; returns the exit status (0 ok, 1 error, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    from fsdp2kit.checkpoint import CheckpointError

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
