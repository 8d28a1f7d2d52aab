"""`fsdp2kit inspect`: a checkpoint's steps and one step's keys, shapes, dtypes and sizes, from metadata alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp2kit._internal.fmt import fmt_bytes
from fsdp2kit.checkpoint import incomplete_dirs, list_steps, read_metadata, resolve_step, step_dir
from fsdp2kit.weights.adapter_checkpoint import read_info


def describe_step(path: Path) -> dict:
    """What a step directory holds, from DCP metadata alone: no process group, no tensor read."""
    metadata = read_metadata(path)
    stored: dict[str, int] = {}
    if isinstance(metadata.storage_data, dict):
        for index, info in metadata.storage_data.items():
            stored[index.fqn] = stored.get(index.fqn, 0) + getattr(info, "length", 0)
    entries = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel, dtype = math.prod(md.size), md.properties.dtype
            name = str(dtype).removeprefix("torch.")
            entries.append(dict(key=key, shape=list(md.size), dtype=name, numel=numel, bytes=numel * dtype.itemsize))
        else:  # a small pickled value (an optimizer hyper-parameter): its size on disk
            entries.append({"key": key, "shape": None, "dtype": "object", "numel": None, "bytes": stored.get(key, 0)})
    info = read_info(path)
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
    """A checkpoint root's steps (complete and incomplete) and one step's contents (or one step directory's)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    if (root / ".metadata").is_file():  # a step directory itself
        return dict(root=str(root.parent), steps=None, incomplete=[], step=None, contents=describe_step(root))
    steps, chosen = list_steps(root), resolve_step(root, step)
    incomplete = [p.name for p in incomplete_dirs(root)]
    contents = describe_step(step_dir(root, chosen)) if chosen is not None else None
    return dict(root=str(root), steps=steps, incomplete=incomplete, step=chosen, contents=contents)


def _inspect_text(report: dict) -> str:
    lines = []
    if report["steps"] is not None:
        lines.append(f"checkpoint root: {report['root']}")
        lines.append(f"complete steps: {', '.join(map(str, report['steps'])) or 'none'}")
        lines += [f"incomplete (ignored): {name}" for name in report["incomplete"]]
    contents = report["contents"]
    if contents is None:
        return "\n".join(lines)
    info = contents["info"]
    lines.append(f"\nstep {info.get('step', report['step'])}: {contents['path']}")
    if info:
        extras = ", ".join(info.get("extra", [])) or "none"
        per_rank = info.get("extra_per_rank", []) + (["rng"] if info.get("rng") else [])
        lines.append(
            f"  saved {info.get('saved_at', '?')} by {info.get('world_size', '?')} rank(s), "
            f"torch {info.get('torch', '?')}, optimizer {info.get('optimizer') or 'none'}"
        )
        kinds = info.get("optimizer_state")
        if kinds:
            held = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
            lines.append(f"  optimizer state in memory (rank 0): {held}; stored as the records below say")
        lines.append(f"  extra: {extras}; per rank: {', '.join(per_rank) or 'none'}")
    hf = ", Hugging Face config.json" if contents["has_hf_config"] else ""
    lines.append(f"  {contents['data_files']} data file(s), {fmt_bytes(contents['data_bytes'])} on disk{hf}")

    groups: dict[str, list[dict]] = {}
    for e in contents["entries"]:
        groups.setdefault(e["key"].split(".", 1)[0], []).append(e)
    for group, entries in groups.items():
        tensors = [e for e in entries if e["shape"] is not None]
        numel, size = sum(e["numel"] for e in tensors), fmt_bytes(sum(e["bytes"] for e in tensors))
        other = f"; {len(entries) - len(tensors)} other value(s)" if len(entries) > len(tensors) else ""
        lines.append(f"  {group:<10} {len(tensors):>5} tensor(s), {numel:,} elements, {size}{other}")
    width = max(len(e["key"]) for e in contents["entries"]) if contents["entries"] else 3
    lines.append(f"\n{'key':<{width}}  {'shape':<16} {'dtype':<9} size")
    for e in contents["entries"]:
        shape = "-" if e["shape"] is None else "(" + ", ".join(map(str, e["shape"])) + ")"
        lines.append(f"{e['key']:<{width}}  {shape:<16} {e['dtype']:<9} {fmt_bytes(e['bytes'])}")
    return "\n".join(lines)


def add_inspect(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="list a checkpoint's steps and one step's keys, shapes, dtypes and sizes",
        description="List the steps under CKPT_DIR (complete and incomplete) and, for the newest complete "
        "step or --step, every key with its shape, dtype and size. Reads DCP metadata only.",
    )
    p.add_argument("ckpt_dir", help="a Checkpointer root, or one step directory")
    p.add_argument("--step", type=int, help="the step to describe (default: the newest complete one)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.set_defaults(func=run_inspect)


def run_inspect(args) -> int:
    report = inspect(args.ckpt_dir, args.step)
    print(json.dumps(report, indent=1) if args.json else _inspect_text(report))
    return 0
