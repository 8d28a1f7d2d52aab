"""`fsdp2kit export-hf`: a Checkpointer directory to Hugging Face safetensors, offline, in one process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fsdp2kit.checkpoint import resolve_step_dir
from fsdp2kit.weights.export import dcp_to_hf, has_tokenizer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_export_hf(subparsers) -> None:
    p = subparsers.add_parser(
        "export-hf",
        help="convert a checkpoint to Hugging Face safetensors that from_pretrained loads",
        description="Convert the newest complete step under CKPT_DIR (or --step, or CKPT_DIR as a step "
        "directory) to consolidated safetensors plus config in OUT_DIR, in one process, with the model's "
        "usual Hugging Face layout. Nothing is unpickled beyond DCP's tensor descriptions. A LoRA/QLoRA "
        "checkpoint (adapters only) needs --base, and is written as PEFT's adapter directory or, with --merge, "
        "as the merged model. The tokenizer is written beside the weights: --tokenizer, else the one in --base, "
        "--config or the step directory.",
    )
    p.add_argument("ckpt_dir", help="a Checkpointer root, or one step directory")
    p.add_argument("out_dir", help="where to write model*.safetensors and config.json")
    p.add_argument("--step", type=int, help="the step to export (default: the newest complete one)")
    p.add_argument(
        "--dtype",
        choices=[*sorted(_DTYPES), "auto"],
        help="cast on export; auto: the dtype the config says the pretrained model was stored in (a bf16 model "
        "trained with fp32 masters is written in bf16 again), as saved without one (default: as saved)",
    )
    p.add_argument("--config", help="a Hugging Face config directory, when the step has no config.json")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    p.add_argument(
        "--base",
        help="a LoRA/QLoRA checkpoint holds only the adapters: the pretrained model directory the run started from",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="with --base: write the base with the adapters folded in (default: PEFT's adapter directory)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the tokenizer directory to write beside the weights (default: the one in --base, --config or the step)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    p.set_defaults(func=run_export_hf)


def run_export_hf(args) -> int:
    source = resolve_step_dir(args.ckpt_dir, args.step)
    dtype = _DTYPES.get(args.dtype)
    if args.dtype == "auto" and not (args.base and not args.merge):  # an adapter directory is written as trained
        where = Path(args.config or source)  # the floating dtype its config.json names, if any
        file = where / "config.json" if where.is_dir() else where
        saved = json.loads(file.read_text()) if file.is_file() else {}
        named = getattr(torch, str(saved.get("dtype") or saved.get("torch_dtype")), None)
        dtype = named if isinstance(named, torch.dtype) and named.is_floating_point else None
    passed = ("config", "max_shard_size", "overwrite", "base", "merge", "tokenizer")  # dcp_to_hf's names too
    out = dcp_to_hf(source, args.out_dir, dtype=dtype, **{name: getattr(args, name) for name in passed})
    if has_tokenizer(out):
        print(f"wrote {out} (with its tokenizer)")
    else:
        print(f"wrote {out} without a tokenizer (none in --base, --config or the step): pass --tokenizer DIR")
    return 0
