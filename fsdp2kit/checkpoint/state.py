"""The state dict a checkpoint holds: model and optimizer shards, and `extra` encoded per rank or shared."""

from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2kit.checkpoint.extras import RNG_KEY, PerRank, RNGState, decode, encode, is_stateful, templates
from fsdp2kit.checkpoint.optim import optimizer_template, optimizer_to_save


def resolve_trainable_only(model: nn.Module, trainable_only: bool | None) -> bool:
    """``None`` means: leave the frozen parameters out when there are any (a LoRA / QLoRA base)."""
    if trainable_only is None:
        return any(not p.requires_grad for p in model.parameters())
    return bool(trainable_only)


def model_options(trainable_only: bool) -> StateDictOptions:
    """DCP's own filter: frozen parameters are neither written nor expected back (buffers still are)."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def state_to_save(
    model: nn.Module, optimizer, extra: dict | None, *, rank: int, rng: bool, trainable_only: bool = False
) -> dict:
    """The nested state dict DCP writes: the model's and optimizer's sharded tensors, and ``extra`` encoded
    (shared values from rank 0, `PerRank` values and RNG states from every rank), its values taken now."""
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=model_options(trainable_only))}
    if optimizer is not None:
        state["optimizer"] = optimizer_to_save(model, optimizer)  # see optim.py for the layout
    shared, mine = {}, {}
    for key, value in (extra or {}).items():
        # A shared value is encoded on every rank too, so that a bad one fails on every rank alike, but
        # stored from rank 0 only: DCP would otherwise keep an arbitrary rank's copy.
        entry = encode(value.value if isinstance(value, PerRank) else value, f"extra[{key!r}]")
        if isinstance(value, (PerRank, RNGState)):
            mine[key] = entry
        elif rank == 0:
            shared[key] = entry
    if rng:
        mine[RNG_KEY] = encode(RNGState(), "RNG state")
    state["extra"] = {"shared": shared, "rank": {str(rank): mine}}
    return state


def state_to_load(model: nn.Module, optimizer, metadata: Metadata, *, rank: int, trainable_only: bool = False) -> dict:
    """The state dict DCP fills in place; ``extra`` as templates shaped after the metadata."""
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=model_options(trainable_only))}
    if optimizer is not None:
        state["optimizer"] = optimizer_template(model, optimizer, metadata)  # in the checkpoint's format
    state["extra"] = {
        "shared": templates(metadata, ("extra", "shared")),
        "rank": {str(rank): templates(metadata, ("extra", "rank", str(rank)))},
    }
    return state


def restore_extra(loaded: dict, extra: dict | None, *, rank: int, rng: bool) -> dict[str, Any]:
    """Put the loaded ``extra`` back: stateful objects in place, plain values into the dict, this
    rank's RNG states into its generators; returns every decoded value (for ``loaded_extra``)."""
    (mine,) = loaded["rank"].values()  # this rank's
    values = {k: decode(v) for k, v in {**loaded["shared"], **mine}.items()}
    rng_state = values.pop(RNG_KEY, None)
    missing_here = [key for key in extra or {} if key not in values]  # PerRank ones only: checked before loading
    for key, target in (extra or {}).items():
        inner = target.value if isinstance(target, PerRank) else target
        if key in missing_here:
            continue
        if is_stateful(inner):
            inner.load_state_dict(values[key])
        else:
            extra[key] = PerRank(values[key]) if isinstance(target, PerRank) else values[key]
    if missing_here:
        warnings.warn(
            f"rank {rank} has no saved value for per-rank extra {missing_here} (the checkpoint "
            "was saved by fewer ranks); keeping the current values",
            stacklevel=4,
        )
    if rng and rng_state is not None:
        RNGState().load_state_dict(rng_state)
    elif rng:
        warnings.warn(
            f"rank {rank}: the checkpoint holds no RNG state for this rank (saved by fewer ranks, "
            "or with rng=False); its random generators are left as they are",
            stacklevel=4,
        )
    return values
