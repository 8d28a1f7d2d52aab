"""Consolidated state dicts (one ``torch.save`` file or safetensors files) read into each rank's shards
(how and why: docs/internals.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from fsdp2kit._internal.agree import all_ranks_or_none
from fsdp2kit._internal.dtensor import local_index, local_shard
from fsdp2kit._internal.fmt import fmt_list, key_problems
from fsdp2kit.weights.allocate import allocate_for_load
from fsdp2kit.weights.hf_layout import clean_fqn, model_tensors
from fsdp2kit.weights.safetensors import SafetensorsReader, index_files

__all__ = ["ImportResult", "full_state_files", "load_full_state_dict", "torch_load_safely"]

# Tried in this order in a directory: Accelerate's FULL_STATE_DICT name, then what zero_to_fp32
# and save_pretrained write (sharded with an index, or one file).
DIR_CANDIDATES = (
    "pytorch_model_fsdp.bin",
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
WRAPPING_KEYS = ("state_dict", "model", "module")


@dataclass
class ImportResult:
    """What a load from another framework's checkpoint did on this rank."""

    format: str  # "dcp" (sharded: FSDP1 SHARDED_STATE_DICT / Accelerate) or "full" (one state dict)
    model_source: str
    optimizer_source: str | None = None
    tensors: int = 0
    skipped_keys: list[str] = field(default_factory=list)  # in the file, non-persistent in the model


def torch_load_safely(path: Path) -> object:
    """``torch.load`` that never runs pickled code, memory-mapped where the file format allows."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # the legacy (pre-1.6, non-zip) format cannot be mapped
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def full_state_files(path: Path) -> list[Path]:
    """The files of a consolidated state dict: ``path`` itself, or what a directory holds."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    for candidate in (path / name for name in DIR_CANDIDATES):
        if candidate.is_file():
            return sorted(set(index_files(candidate).values())) if candidate.suffix == ".json" else [candidate]
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    raise FileNotFoundError(
        f"{path} holds no consolidated state dict (looked for {', '.join(DIR_CANDIDATES)}, *.safetensors); "
        f"it has: {fmt_list(sorted(p.name for p in path.iterdir()))}"
    )


class _TorchFiles:
    """The tensors of ``torch.save``'d state dicts, memory-mapped, behind SafetensorsReader's methods."""

    def __init__(self, files: list[Path]):
        self.tensors: dict[str, torch.Tensor] = {}
        self.files: dict[str, Path] = {}  # key -> file, as SafetensorsReader's
        for f in files:
            data = torch_load_safely(f)
            if isinstance(data, dict) and not any(isinstance(v, torch.Tensor) for v in data.values()):
                # torch.save({"model": state_dict, ...}) and DeepSpeed-style {"module": ...}
                data = next((data[k] for k in WRAPPING_KEYS if isinstance(data.get(k), dict)), data)
            if not isinstance(data, dict):
                raise ValueError(f"{f} holds a {type(data).__name__}, not a state dict")
            for k, v in data.items():
                if not isinstance(v, torch.Tensor):
                    raise ValueError(
                        f"{f}: {k!r} is a {type(v).__name__}, not a tensor; is this an optimizer or training-state "
                        "file rather than model weights?"
                    )
                self.tensors[k], self.files[k] = v, f

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[key][index]

    def close(self) -> None:
        self.tensors.clear()


def load_full_state_dict(model: nn.Module, path: str | os.PathLike) -> ImportResult:
    """Load a consolidated state dict into a model prepared with `shard_model`, on every rank.

    ``path``: a ``torch.save`` or safetensors file, or a directory of one (Accelerate's
    FULL_STATE_DICT, what DeepSpeed's ``zero_to_fp32.py`` or ``save_pretrained`` writes). Keys are
    module names (FSDP1 wrapper segments ignored; one name of a tied weight suffices); values are
    cast to each parameter's dtype. Missing, unexpected (but non-persistent buffers, which are
    skipped and listed in the result) or mis-shaped keys are a ``ValueError`` on every rank before
    anything is copied. A model still on the meta device gets storage first.
    """
    path = Path(path)
    with all_ranks_or_none(model, "load_full_state_dict"):
        files = full_state_files(path)
        if all(f.suffix == ".safetensors" for f in files):
            reader = SafetensorsReader.of(files)
        elif any(f.suffix == ".safetensors" for f in files):
            raise ValueError(f"mixed safetensors and torch files: {fmt_list([str(f) for f in files])}")
        else:
            reader = _TorchFiles(files)
        by_name = {clean_fqn(k): k for k in reader.files}
        tensors, aliases = model_tensors(model)
        sources: dict[str, str] = {}  # a tensor's first name -> its key in the file (one name of a tied weight)
        for name, first in aliases.items():
            if name in by_name:
                sources.setdefault(first, by_name[name])
        firsts = [name for name, first in aliases.items() if name == first]
        missing = [name for name in firsts if name not in sources]
        mismatched = [
            f"{name} {list(reader.shape(sources[name]))} in the file, {list(tensors[name].shape)} in the model"
            for name in firsts
            if name in sources and tuple(reader.shape(sources[name])) != tuple(tensors[name].shape)
        ]
        skippable = {clean_fqn(n) for n, _ in model.named_buffers(remove_duplicate=False)}  # in extra: non-persistent
        extra = sorted(n for n in by_name if n not in tensors)
        skipped = [n for n in extra if n in skippable]
        unexpected = [n for n in extra if n not in skippable]
        problems = key_problems(missing, unexpected, mismatched, source="the file")
        if problems:
            reader.close()
            raise ValueError(f"load_full_state_dict({path}) into {type(model).__name__}: " + "; ".join(problems))
    if any(t.is_meta for t in tensors.values()):
        allocate_for_load(model)
        tensors, _ = model_tensors(model)  # allocation may replace plain (unsharded) tensors
    result = ImportResult("full", ", ".join(str(f) for f in files), skipped_keys=skipped)
    with all_ranks_or_none(model, "load_full_state_dict"), torch.no_grad():
        try:
            for first, key in sources.items():
                target = tensors[first]
                local = local_shard(target)
                if local.numel():
                    local.copy_(reader.read(key, local_index(target)))
                result.tensors += 1
        finally:
            reader.close()
    return result
