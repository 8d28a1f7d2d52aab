"""`load_pretrained`: a local Hugging Face checkpoint read straight into each rank's shards."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from fsdp2kit._internal.agree import all_ranks_or_none
from fsdp2kit._internal.dtensor import local_index, local_shard
from fsdp2kit._internal.fmt import fmt_list, key_problems
from fsdp2kit.weights.adapters import is_peft_model, peft_init_fn, peft_view
from fsdp2kit.weights.allocate import allocate_for_load, target_device
from fsdp2kit.weights.hf_layout import model_tensors, plan_load
from fsdp2kit.weights.materialize import materialize
from fsdp2kit.weights.nf4 import allocate_nf4, fill_nf4, is_nf4
from fsdp2kit.weights.safetensors import SafetensorsReader, checkpoint_files


@dataclass
class LoadResult:
    """What `load_pretrained` did on this rank."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0  # bytes this rank read from the files (its shards only, where it could)


def load_pretrained(model: nn.Module, hf_dir: str | os.PathLike, *, strict: bool = True) -> LoadResult:
    """Read a local Hugging Face safetensors checkpoint straight into each rank's shards (docs/loading.md).

    Call it after `shard_model`, on every rank (a meta-device model gets its storage here). Each
    rank copies only the rows its shards hold; a truncated or padded file is a ``ValueError`` naming
    it. Keys and layouts are mapped with transformers' own renamings and weight converters, as
    ``from_pretrained`` does; values are cast to each parameter's dtype; a tied weight needs one
    of its names on disk. NF4 weights (`quantize_nf4`) are quantized from each rank's rows
    (docs/lora.md). A peft model's base is read under the base's own names; the adapters keep their init.

    With ``strict=True`` a missing key, an unexpected key or a different shape is a ``ValueError``
    naming the keys, raised before anything is read. With ``strict=False`` shapes still raise and
    the missing / unexpected keys are returned; missing parameters get `materialize`'s values.
    Non-persistent buffers are recomputed as in `materialize`.
    """
    hf_dir = Path(hf_dir)
    with all_ranks_or_none(model, "load_pretrained"):
        files = checkpoint_files(hf_dir)
        reader = SafetensorsReader(files)
        shapes = {k: reader.shape(k) for k in files}
        target, tensors, aliases = _load_targets(model)
        groups, missing, unexpected, mismatched = plan_load(target, shapes, tensors, aliases)
        problems = key_problems(missing if strict else (), unexpected if strict else (), mismatched)
        if nf4_missing := [n for n in missing if n in tensors and is_nf4(tensors[n])]:
            problems.append(f"NF4 weights missing from the checkpoint (quantized from it): {fmt_list(nf4_missing)}")
        if problems:
            hint = " Is this the checkpoint of another model?" if len(groups) < len(tensors) // 2 else ""
            raise ValueError(f"load_pretrained({hf_dir}) into {type(model).__name__}: " + "; ".join(problems) + hint)
    with all_ranks_or_none(model, "load_pretrained"):
        allocate_nf4(model, target_device(model, None))  # meta NF4 placeholders: filled below, not initialised
    if is_peft_model(model) and any(p.is_meta for p in model.parameters()):
        materialize(model, init_fn=peft_init_fn(model))  # the adapters' own init; the base is read below
    elif missing and any(t.is_meta for t in tensors.values()):
        materialize(model)  # the parameters the checkpoint lacks get the model's own init
    else:
        allocate_for_load(model, "load_pretrained")
    _, tensors, _ = _load_targets(model)  # allocation may have replaced plain (unsharded) tensors

    with all_ranks_or_none(model, "load_pretrained"), torch.no_grad():
        try:
            for group in groups:
                _load_group(target, group, tensors, reader)
        finally:
            reader.close()
    return LoadResult(missing, unexpected, sum(len(group.targets) for group in groups), reader.bytes)


def _load_targets(model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, str]]:
    """The model whose checkpoint is read and its tensors (a peft model: its base's, under the base's names)."""
    tensors, aliases = model_tensors(model)
    return peft_view(model, tensors, aliases) if is_peft_model(model) else (model, tensors, aliases)


def _copy_into(target: torch.Tensor, part: torch.Tensor) -> None:
    shard = tuple(local_shard(target).shape)
    if tuple(part.shape) != shard:  # copy_ would broadcast a wrong part silently
        raise RuntimeError(f"internal: read a part of shape {tuple(part.shape)} for a shard of shape {shard}")
    if is_nf4(target):
        fill_nf4(target, part)  # quantized with the shard group's agreed scaler mean (collective)
        return
    local_shard(target).copy_(part)


def _load_group(model: nn.Module, group, tensors: dict[str, torch.Tensor], reader: SafetensorsReader) -> None:
    target = tensors[group.targets[0]]
    index = local_index(target)
    if group.converter is None:
        if is_nf4(target):
            _copy_into(target, reader.read(group.source_keys[0], index))
        elif local_shard(target).numel():  # straight from the file into a CPU shard when the dtypes agree
            reader.read(group.source_keys[0], index, into=local_shard(target))
        return
    whole_inner = all(s.indices(n) == (0, n, 1) for s, n in zip(index[1:], target.shape[1:]))
    # The target's dim 0 is the list of sources (experts) and only dim 0 is sharded: this rank converts
    # its own experts and nothing else. Otherwise whole sources, and this rank's part of each output.
    mine = group.merges_dim0() and whole_inner
    if mine and local_shard(target).numel() == 0:
        return
    mine_keys = [ks[i] for ks in group.sources.values() for i in range(*index[0].indices(len(ks)))] if mine else []
    for name, full in group.convert(model, {k: reader.read(k) for k in mine_keys or group.source_keys}).items():
        _copy_into(tensors[name], full if mine else full[local_index(tensors[name])])
