"""Reading safetensors files a rank at a time: the index, the checked headers, and only the rows a shard needs."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fsdp2kit._internal.fmt import fmt_list


def checkpoint_files(hf_dir: Path) -> dict[str, Path]:
    """checkpoint key -> file, from the index of a sharded checkpoint or the single file."""
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"load_pretrained: {hf_dir} is not a directory")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return index_files(index)
    single = hf_dir / "model.safetensors"
    candidates = [single] if single.is_file() else sorted(hf_dir.glob("*.safetensors"))
    if not candidates:
        found = sorted(p.name for p in hf_dir.iterdir())[:10]
        raise FileNotFoundError(
            f"load_pretrained: no model.safetensors, model.safetensors.index.json or *.safetensors in {hf_dir} "
            f"(found {found}); .bin / .pt checkpoints are not read (they unpickle code): convert them first"
        )
    return SafetensorsReader.of(candidates).files


def index_files(index: Path) -> dict[str, Path]:
    """key -> file, from a sharded checkpoint's ``*.index.json``; every file it names must be there."""
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map")
    files = {k: index.parent / v for k, v in weight_map.items()}
    absent = sorted({str(f) for f in files.values() if not f.is_file()})
    if absent:
        raise FileNotFoundError(f"{index} names files that are not there: {fmt_list(absent)}")
    return files


def check_file(path: Path) -> list[str]:
    """The keys of one safetensors file, checked by ``safe_open`` (the tensors tile the data region to
    the end of the file): a truncated or padded file is a ``ValueError`` naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as exc:
        size = path.stat().st_size
        message = f"{path} is not a valid safetensors file of {size} bytes"
        with open(path, "rb") as f, contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, IndexError):
            n = int.from_bytes(f.read(8), "little")  # the size the header describes: 8 + header + data region
            header = json.loads(f.read(min(n, 100_000_000)))
            end = 8 + n + max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)
            if end != size:
                message += f" (its header describes {end} bytes: {'padded' if end < size else 'truncated'})"
        raise ValueError(f"{message}: {exc}") from None


class SafetensorsReader:
    """Tensors, or the box of rows and columns a rank needs, through ``safe_open``'s ``get_slice``; each
    part is copied out of the file's memory map at once, so nothing refers to the file afterwards."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.handles: dict[Path, tuple[set[str], object]] = {}  # its keys, its safe_open handle
        self.bytes = 0

    @classmethod
    def of(cls, paths: list[Path]) -> SafetensorsReader:
        """A reader of every tensor of these files (each checked now)."""
        return cls({k: path for path in paths for k in check_file(path)})

    def _slice(self, key: str):
        path = self.files[key]
        if path not in self.handles:  # checked (a clear error for a bad file) before safe_open
            self.handles[path] = (set(check_file(path)), safe_open(path, framework="pt"))
        keys, handle = self.handles[path]
        if key not in keys:
            raise KeyError(f"{key} is not in {path} (the index says it is)")
        return handle.get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def read(
        self, key: str, index: tuple[slice, ...] | None = None, *, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor ``key``, or ``key[index]`` (one slice per dim); with ``into``, copied into it (returned)."""
        part = self._slice(key)
        part = part[tuple(index) if index and part.get_shape() else ()]
        self.bytes += part.numel() * part.element_size()
        if into is None:
            return part.clone()
        if tuple(part.shape) != tuple(into.shape):
            raise RuntimeError(f"internal: {key}{list(index or ())} does not fit a destination of shape {into.shape}")
        return into.copy_(part)

    def close(self) -> None:
        self.handles.clear()
