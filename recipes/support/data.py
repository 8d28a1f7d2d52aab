"""The recipe's data, set up once per node: the tokenizer, the cached rows of each split, the loader.

Local rank 0 of each node builds what is missing (a tokenizer, the tokenized and packed rows)
while the other ranks wait; an error there (a bad record, a missing file) reaches every rank as
the same `DataError`, so all ranks stop together with one clear message instead of hanging.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from support.demo_data import demo_corpus
from support.formats import FormatSpec
from support.loader import ResumableLoader
from support.rows import DataError, DataSplits, load_rows, prepare_data
from support.tokenizer import load_tokenizer, train_demo_tokenizer

__all__ = [
    "DataError",
    "DataSplits",
    "ResumableLoader",
    "build_once",
    "check_vocab",
    "describe",
    "setup_data",
    "setup_tokenizer",
]


def build_once(build: Callable[[], Any], *, rank: int, local_rank: int, world_size: int) -> Any:
    """``build()`` on local rank 0 of each node, the others waiting; its (picklable) result on every rank.

    The wait is a collective, so it is bounded by the process group's timeout (30 minutes by
    default): tokenizing more than that on one node wants a bigger ``[data] num_proc``, or the
    cache built ahead of time by a one-process run.
    """
    result, error, exc = None, None, None
    if local_rank == 0:
        try:
            result = build()
        except Exception as e:  # reported to every rank, re-raised here with its traceback
            exc, error = e, (str(e) if isinstance(e, DataError | FileNotFoundError) else f"{type(e).__name__}: {e}")
    if not (dist.is_available() and dist.is_initialized()) or world_size == 1:
        if exc is not None:
            raise exc
        return result
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (error, result))
    failed = next((e for e, _ in gathered if e), None)
    if failed is not None:
        if exc is not None:
            raise DataError(error) from exc
        raise DataError(failed)
    return gathered[rank - local_rank][1]  # torchrun numbers a node's ranks consecutively


def setup_tokenizer(path: str, cache_dir: str, *, rank: int, local_rank: int, world_size: int):
    """The tokenizer at ``path``, or (empty path) the demo BPE, trained once into the cache."""
    if path:
        return load_tokenizer(path)
    demo = Path(cache_dir) / "demo-tokenizer"

    def build() -> str:
        if not (demo / "tokenizer.json").is_file():
            tmp = demo.with_name(f".demo-tokenizer.{uuid.uuid4().hex[:8]}")
            train_demo_tokenizer(tmp)
            try:
                os.rename(tmp, demo)  # whole or not at all, as the rows cache
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # another node's copy won; it is identical
        return str(demo)

    return load_tokenizer(build_once(build, rank=rank, local_rank=local_rank, world_size=world_size))


def setup_data(data_cfg, eval_cfg, tokenizer, *, seed: int, rank: int, local_rank: int, world_size: int) -> DataSplits:
    """The rows of the training split and the held-out split (or None), built once and cached."""
    if eval_cfg.every and not eval_cfg.files and not eval_cfg.fraction:
        raise DataError("[eval] every is set but there is no held-out split: set [eval] files or [eval] fraction")
    spec = FormatSpec(
        data_cfg.format,
        text_field=data_cfg.text_field,
        messages_field=data_cfg.messages_field,
        prompt_field=data_cfg.prompt_field,
        completion_field=data_cfg.completion_field,
        template=data_cfg.template,
    )
    files = [f for f in data_cfg.files.split(",") if f]
    if not files and data_cfg.format != "text":
        raise DataError(f"[data] format = {data_cfg.format!r} needs [data] files (the embedded corpus is plain text)")

    def build():
        default = None
        if not files:
            import datasets

            default = datasets.Dataset.from_dict({data_cfg.text_field: demo_corpus()})
        path, _ = prepare_data(
            files=files,
            tokenizer=tokenizer,
            spec=spec,
            seq_len=data_cfg.seq_len,
            packing=data_cfg.packing,
            cache_dir=data_cfg.cache_dir,
            eval_files=[f for f in eval_cfg.files.split(",") if f],
            eval_fraction=eval_cfg.fraction,
            seed=seed,
            num_proc=data_cfg.num_proc,
            default_records=default,
        )
        return str(path)

    path = build_once(build, rank=rank, local_rank=local_rank, world_size=world_size)
    return load_rows(Path(path))


def check_vocab(tokenizer, model) -> None:
    """A tokenizer with ids past the model's embedding would fail in the first forward, far from the cause."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise DataError(
            f"the tokenizer ({tokenizer.name_or_path or 'demo'}) has {len(tokenizer)} tokens but the model's "
            f"vocabulary has {vocab}: use the tokenizer the model was trained with"
        )


def describe(splits: DataSplits, seq_len: int) -> str:
    """One line per split for the log: records -> examples -> rows, answer tokens, what was cut."""
    lines = []
    for name in ("train", "eval"):
        s = splits.stats.get(name)
        if not s:
            continue
        line = (
            f"data {name}: {s['records']} records -> {s['examples']} examples -> {s['rows']} rows of {seq_len} "
            f"({s['fill']:.0%} filled), {s['answer_tokens']} answer tokens"
        )
        if s["truncated"]:
            line += f"; {s['truncated']} truncated to seq_len"
        if s.get("no_answer"):
            line += f"; {s['no_answer']} dropped: no answer tokens"
        if s["cut_off"]:
            line += f"; {s['cut_off']} dropped: seq_len cut off their whole answer"
        lines.append(line)
    lines.append(f"data cache: {splits.stats['cache']}")
    return "\n".join(lines)
