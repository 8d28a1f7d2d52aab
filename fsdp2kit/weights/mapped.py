"""Zero-copy CPU shards: a rank's rows of a safetensors file adopted as its shard through a private memory map.

A CPU shard whose dtype is the file's and whose rows are one contiguous byte range of the
file needs no copy: it can be a view of the file mapped copy-on-write (``MAP_PRIVATE``, what
``torch.UntypedStorage.from_file(shared=False)`` maps, and what safetensors' ``safe_open``,
hence transformers' ``from_pretrained``, hands out). Reading then happens page by page when a
byte is first used, and the first write to a page (the optimizer's first step) gives this
process a private copy of that page: the file is never written through.

FSDP2 adopts such a tensor as its sharded storage without a copy when the DTensor parameter is
replaced inside ``nn.Module._apply`` (``FSDPParam.reset_sharded_param``), provided the rank's
rows fill FSDP's padded shard exactly; where they do not (the last rank of an uneven split)
FSDP copies them into padded storage itself, which is still correct.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit.weights.nf4 import is_nf4
from fsdp2kit.weights.safetensors import SafetensorsReader


class MappedFiles:
    """One private (copy-on-write) mapping per safetensors file, as a flat uint8 tensor."""

    def __init__(self) -> None:
        self.maps: dict[Path, torch.Tensor] = {}
        self.bytes = 0  # bytes of shards that are views of a mapping

    def bytes_of(self, path: Path) -> torch.Tensor:
        if path not in self.maps:
            size = path.stat().st_size
            storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)  # MAP_PRIVATE
            self.maps[path] = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
        return self.maps[path]


def _mappable(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """A parameter whose local shard can be a view of the file's rows."""
    if not isinstance(target, DTensor) or is_nf4(target) or target.dtype != dtype:
        return False
    if target.device_mesh.device_type != "cpu":
        return False
    # FSDP's own Shard(0) (and Replicate over HSDP's replicate dim): a block of whole rows.
    # Not _StridedShard (FSDP over a tensor-parallel dim): its rows are not one chunk.
    return all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in target.placements)


def _rows(t: DTensor) -> tuple[int, int]:
    """This rank's rows ``[first, last)`` of a tensor placed Shard(0) / Replicate: each Shard(0) splits the last block.

    The same split as `fsdp2kit._internal.dtensor.local_index` (torch.chunk's sizes), in integers.
    """
    coordinate = t.device_mesh.get_coordinate()
    first, length = 0, t.shape[0]
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Shard):
            size, offset = Shard.local_shard_size_and_offset(length, t.device_mesh.size(mesh_dim), coordinate[mesh_dim])
            first, length = first + offset, size
    return first, first + length


def mapped_shards(
    groups, tensors: dict[str, torch.Tensor], reader: SafetensorsReader, maps: MappedFiles
) -> dict[str, DTensor]:
    """Model key -> a DTensor like that parameter whose local shard is a view of the mapped file's rows.

    Qualifies: a plain (not converted) checkpoint tensor, a still-meta CPU DTensor parameter
    sharded along dim 0 only, the same dtype on disk as in the model, and a start that is
    aligned to the element size. Everything else is read with a copy, as before.
    """
    views: dict[str, DTensor] = {}
    for group in groups:
        if group.converter is not None or len(group.targets) != 1:
            continue
        target = tensors[group.targets[0]]
        if not target.is_meta or not isinstance(target, torch.nn.Parameter):
            continue
        key = group.source_keys[0]
        dtype = reader.dtype(key)
        if not _mappable(target, dtype):
            continue
        shape = reader.shape(key)
        if not shape or tuple(shape) != tuple(target.shape):
            continue
        path, data_start, entry = reader.entry(key)
        begin, end = entry["data_offsets"]
        first, last = _rows(target)
        row_bytes = (end - begin) // shape[0]
        start = data_start + begin + first * row_bytes
        if start % dtype.itemsize or tuple(local_shard(target).shape) != (last - first, *shape[1:]):
            continue
        raw = maps.bytes_of(path)[start : start + (last - first) * row_bytes]
        views[group.targets[0]] = _adopt(target, raw.view(dtype).view(last - first, *shape[1:]))
        maps.bytes += (last - first) * row_bytes
    return views


def _adopt(t: torch.Tensor, view: torch.Tensor) -> DTensor:
    """A DTensor like ``t`` whose local shard is ``view`` (no copy)."""
    return DTensor.from_local(view, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
