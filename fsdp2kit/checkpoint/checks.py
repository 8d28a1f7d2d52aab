"""Checks a checkpoint against the model before anything is read, in sentences that name the keys."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from fsdp2kit._internal.fmt import fmt_list, key_problems
from fsdp2kit.checkpoint.extras import RNG_KEY, PerRank, RNGState, metadata_paths

MAX_LISTED = 8
# Checkpoint dtype -> the dtypes it loads into without a word but a note: the bf16 (or fp16) masters
# and optimizer states of runs before fp32 masters were the rule, read into fp32 ones (exact). Every
# other difference, a narrowing one above all, stays an error.
UPCASTS = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def check_optimizer(info: dict, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The checkpoint's optimizer (``fsdp2kit.json``'s ``optimizer``, its class name) against the one
    given. AdamW's and the low-bit AdamWs' states have the same keys and shapes, so without this an
    8-bit state would load into a full-precision AdamW (or the reverse) without a word."""
    saved = info.get("optimizer")
    family = {"OffloadedAdamW": "AdamW"}  # the same state, held in host memory
    here = type(optimizer).__name__ if optimizer is not None else None
    if here is None or saved is None or family.get(saved, saved) == family.get(here, here):
        return []
    return [
        f"the checkpoint holds the state of optimizer {saved}, but it is being loaded into {here}: "
        f"build the optimizer the run was saved with ({saved}), or load with optimizer=None to start the "
        "optimizer afresh"
    ]


def check_against(
    state: dict, metadata: Metadata, path: Path, with_optimizer: bool, upcast: list[str] | None = None
) -> list[str]:
    """What stands between this state dict and the checkpoint, in sentences that name the keys.
    Tensors stored in a dtype of `UPCASTS` and wanted in its wider one are no problem (DCP's reader
    copies each record into the model's tensor, converting it): their keys go to ``upcast``."""
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict({k: v for k, v in state.items() if k != "extra"})
    missing, kind, shape, dtype = [], [], [], []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            missing.append(key)
        elif isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                kind.append(f"{key} (checkpoint: not a tensor)")
            elif tuple(md.size) != tuple(value.shape):
                shape.append(f"{key}: checkpoint {tuple(md.size)}, here {tuple(value.shape)}")
            elif md.properties.dtype != value.dtype:
                if UPCASTS.get(md.properties.dtype) == value.dtype and upcast is not None:
                    upcast.append(f"{key} ({md.properties.dtype} -> {value.dtype})")
                    continue
                dtype.append(f"{key}: checkpoint {md.properties.dtype}, here {value.dtype}")
        elif not isinstance(md, BytesStorageMetadata):
            kind.append(f"{key} (checkpoint: a tensor, here a {type(value).__name__})")
    prefixes = ("model.", "optimizer.") if with_optimizer else ("model.",)
    unexpected = [k for k in saved if k.startswith(prefixes) and k not in flat]

    problems = []
    if with_optimizer and not any(k.startswith("optimizer.") for k in saved):
        problems.append(
            f"{path.name} was saved without optimizer state: load it with optimizer=None to start the optimizer afresh"
        )
        missing = [k for k in missing if not k.startswith("optimizer.")]
    problems += key_problems(missing, unexpected, shape, holder="this model/optimizer")
    if dtype:
        problems.append(f"dtype mismatch: {fmt_list(dtype, MAX_LISTED)}")
    if kind:
        problems.append(f"tensor/non-tensor mismatch: {fmt_list(kind, MAX_LISTED)}")
    if missing or unexpected or shape:
        problems.append("is this a checkpoint of another model (or another optimizer)?")
    return problems


def check_extra_keys(extra: dict | None, metadata: Metadata) -> list[str]:
    """Every key asked for was saved: shared ones by rank 0, per-rank ones by at least one rank
    (a rank that did not exist at save time keeps its value, see PerRank)."""
    if not extra:
        return []
    shared, per_rank = set(), set()
    for path in metadata_paths(metadata).values():
        if path[:2] == ("extra", "shared") and len(path) > 2:
            shared.add(path[2])
        elif path[:2] == ("extra", "rank") and len(path) > 3 and path[3] != RNG_KEY:
            per_rank.add(path[3])
    missing = [
        k for k, v in extra.items() if k not in (per_rank | shared if isinstance(v, (PerRank, RNGState)) else shared)
    ]
    if missing:
        have = sorted(shared) + [f"{k} (per rank)" for k in sorted(per_rank)]
        return [f"extra key(s) {missing} not in the checkpoint, which has {have or 'no extra'}"]
    return []
