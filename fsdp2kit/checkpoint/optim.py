"""The optimizer in a checkpoint: format 2 written (tensors one record each, hyper-parameters once per
param group), format 1 (per parameter) still read: docs/checkpoint-format.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from fsdp2kit.checkpoint.extras import decode, encode, templates

FORMAT = 2
PACKED = "packed"
# Format 1's layout, kept to read older checkpoints: one key per parameter, state and hyper-parameter.
FORMAT1_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _sharded(value: Any) -> bool:
    """A state DCP stores as a record of its own: a tensor with a shape (a DTensor always)."""
    return isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.dim() > 0)


def optimizer_to_save(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"state": {fqn: {name: tensor}}, "packed": <JSON + tensors entry>}`` for DCP to write."""
    osd = get_optimizer_state_dict(model, optimizer)
    state: dict[str, dict[str, Any]] = {}
    scalars: dict[str, tuple[list[torch.Tensor], list[list[str]]]] = {}
    values: dict[str, dict[str, Any]] = {}
    for fqn, entries in osd["state"].items():
        for name, value in entries.items():
            if _sharded(value):
                state.setdefault(fqn, {})[name] = value
            elif isinstance(value, torch.Tensor):
                dtype = str(value.dtype).removeprefix("torch.")
                ts, keys = scalars.setdefault(dtype, ([], []))
                ts.append(value.detach().reshape(()))
                keys.append([fqn, name])
            else:
                values.setdefault(fqn, {})[name] = value
    packed = {
        "format": FORMAT,
        "param_groups": osd["param_groups"],
        "scalars": {dtype: {"keys": keys, "values": torch.stack(ts)} for dtype, (ts, keys) in scalars.items()},
        "values": values,
    }
    return {"state": state, PACKED: encode(packed, "optimizer state")}


def state_kinds(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """How this rank's optimizer holds its tensor states in memory, counted (``{"float32": 6}``), for
    ``fsdp2kit inspect``: DCP stores a quantized state dequantized, so the records do not tell."""
    kinds: dict[str, int] = {}
    for entries in optimizer.state.values():
        for value in entries.values():
            if not _sharded(value):
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            if type(local) is torch.Tensor:
                label = str(local.dtype).removeprefix("torch.")
            else:  # a tensor subclass: torchao's low-bit states carry their block
                block = getattr(local, "block_size", None)
                label = type(local).__name__ + (f", blocks of {block}" if block else "")
            kinds[label] = kinds.get(label, 0) + 1
    return dict(sorted(kinds.items()))


def optimizer_format(metadata: Metadata) -> int | None:
    """Which optimizer format a checkpoint holds: 2, 1, or None (saved without an optimizer)."""
    keys = metadata.state_dict_metadata
    if f"optimizer.{PACKED}.json" in keys:
        return FORMAT
    if any(k.startswith("optimizer.") for k in keys):
        return 1
    return None


def optimizer_template(model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata) -> dict:
    """What DCP fills in place on load, in the checkpoint's format (format 2: plus the packed entry)."""
    if optimizer_format(metadata) == 1:
        return get_optimizer_state_dict(model, optimizer, options=FORMAT1_OPTIONS)
    # The records as a save makes them, and the packed entry shaped after the metadata.
    return {"state": optimizer_to_save(model, optimizer)["state"], PACKED: templates(metadata, ("optimizer", PACKED))}


def restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    """Load what DCP read (either format) into ``optimizer``."""
    if PACKED not in loaded:  # format 1: already flattened per parameter
        set_optimizer_state_dict(model, optimizer, loaded, options=FORMAT1_OPTIONS)
        return
    packed = decode(loaded[PACKED])
    if packed.get("format") != FORMAT:
        raise ValueError(
            f"the checkpoint's optimizer is in format {packed.get('format')!r}, which this fsdp2kit "
            f"(format {FORMAT}) cannot read: load it with the fsdp2kit that wrote it, or upgrade"
        )
    # Rebuilt in format 1's flattened layout, whose loader maps FQNs to this optimizer's groups.
    flat: dict[str, Any] = {}
    for fqn, entries in [*loaded["state"].items(), *packed["values"].items()]:
        flat.update({f"state.{fqn}.{k}": v for k, v in entries.items()})
    for block in packed["scalars"].values():
        flat.update({f"state.{fqn}.{k}": v.clone() for (fqn, k), v in zip(block["keys"], block["values"])})
    for group in packed["param_groups"]:
        flat.update(
            {f"param_groups.{fqn}.{k}": v for fqn in group["params"] for k, v in group.items() if k != "params"}
        )
    try:
        set_optimizer_state_dict(model, optimizer, flat, options=FORMAT1_OPTIONS)
    except KeyError as e:  # torch looks each parameter's hyper-parameters up by FQN
        raise ValueError(
            f"this optimizer has a parameter the checkpoint's param groups do not list ({e}): "
            "was it saved with another model, or another grouping of the parameters?"
        ) from e
