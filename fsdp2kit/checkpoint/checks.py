"""Checks before a load reads anything: keys, shapes, dtypes, files, and every record's CRC-32
(docs/checkpoint-format.md, "Integrity")."""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import BinaryIO

import torch
from isal.isal_zlib import crc32
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from fsdp2kit._internal.fmt import fmt_list, key_problems
from fsdp2kit.checkpoint.extras import RNG_KEY, PerRank, RNGState, templates

MAX_LISTED = 8
# Checkpoint dtype -> the wider one it loads into with a warning (the bf16/fp16 masters and optimizer states
# of runs before fp32 masters were the rule, exact in fp32); every other difference stays an error.
UPCASTS = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def check_optimizer(info: dict, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The checkpoint's optimizer class against this one: AdamW's and the low-bit AdamWs' states have the same
    keys and shapes, so nothing else would stop an 8-bit state loading into a full-precision AdamW."""
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


def check_against(state: dict, metadata: Metadata, path: Path, with_optimizer: bool, upcast: list[str]) -> list[str]:
    """What stands between this state dict and the checkpoint, naming the keys; tensors stored in a dtype of
    `UPCASTS` and wanted in its wider one go to ``upcast`` instead (DCP's reader converts them)."""
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
                if UPCASTS.get(md.properties.dtype) == value.dtype:
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
    for label, items in (("dtype mismatch", dtype), ("tensor/non-tensor mismatch", kind)):
        if items:
            problems.append(f"{label}: {fmt_list(items, MAX_LISTED)}")
    if missing or unexpected or shape:
        problems.append("is this a checkpoint of another model (or another optimizer)?")
    return problems


def check_extra_keys(extra: dict | None, metadata: Metadata) -> list[str]:
    """Every key asked for was saved: shared ones by rank 0, per-rank ones by at least one rank
    (a rank that did not exist at save time keeps its value, see PerRank)."""
    if not extra:
        return []
    saved = templates(metadata, ("extra",))
    shared = set(saved.get("shared", {}))
    per_rank = {key for mine in saved.get("rank", {}).values() for key in mine} - {RNG_KEY}
    missing = [
        k for k, v in extra.items() if k not in (per_rank | shared if isinstance(v, (PerRank, RNGState)) else shared)
    ]
    if missing:
        have = sorted(shared) + [f"{k} (per rank)" for k in sorted(per_rank)]
        return [f"extra key(s) {missing} not in the checkpoint, which has {have or 'no extra'}"]
    return []


CHECKSUMS = "zip-crc32"
"""What ``fsdp2kit.json``'s ``checksums`` says of a step whose records can be verified."""

_NAME_LENGTH, _EXTRA_LENGTH = 10, 11  # fields of a local file header (zipfile.structFileHeader)


class _Window:
    """Bytes ``[start, start + length)`` of an open file as a file of their own: one record, which
    is a whole zip archive, for ``zipfile`` (which looks for the archive's end at the file's end)."""

    def __init__(self, fh: BinaryIO, start: int, length: int):
        self._fh, self._start, self._length, self._pos = fh, start, length, 0

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = max(0, (0, self._pos, self._length)[whence] + offset)
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._length if n is None or n < 0 else min(self._length, self._pos + n)
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(max(0, end - self._pos))
        self._pos += len(data)
        return data


def _check_record(fh: BinaryIO, offset: int, length: int, buffer: memoryview) -> str | None:
    """What is wrong with the archive at ``[offset, offset + length)``, or None: zipfile reads its directory,
    each entry's bytes are CRC'd here in ``buffer``-sized reads (faster than zipfile's reader for small ones)."""
    try:
        with zipfile.ZipFile(_Window(fh, offset, length)) as archive:
            entries = archive.infolist()
        for entry in entries:
            if entry.CRC == 0 and entry.file_size:
                continue  # written with torch's CRC-32 off: nothing to check against
            fh.seek(offset + entry.header_offset)
            header = struct.unpack(zipfile.structFileHeader, fh.read(zipfile.sizeFileHeader))
            start = entry.header_offset + zipfile.sizeFileHeader + header[_NAME_LENGTH] + header[_EXTRA_LENGTH]
            if header[0] != zipfile.stringFileHeader or start + entry.compress_size > length:
                return f"{entry.filename}: bad local header"
            fh.seek(offset + start)
            crc, left = 0, entry.compress_size
            while left:
                n = fh.readinto(buffer[: min(left, len(buffer))])
                if not n:
                    return f"{entry.filename}: the file ends inside it"
                crc, left = crc32(buffer[:n], crc), left - n
            if crc != entry.CRC:
                return f"{entry.filename}: CRC-32 {crc:#010x}, stored {entry.CRC:#010x}"
    except Exception as e:  # zipfile.BadZipFile, or a directory too garbled for zipfile to say so
        return f"{type(e).__name__}: {e}"
    return None


def verify_files(metadata: Metadata, path: Path, rank: int = 0, world: int = 1, checksums: bool = True) -> list[str]:
    """One problem per data file that is missing, too short or (``checksums``: this rank's every ``world``-th,
    at the save's world size the file it wrote) fails a record's CRC-32, naming it and the first bad record."""
    records: dict[str, set[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        records.setdefault(info.relative_path, set()).add((info.offset, info.length))
    problems = []
    for name, spans in sorted(records.items()):
        file, end = path / name, max(offset + length for offset, length in spans)
        if not file.is_file():
            problems.append(f"data file {file} is missing")
        elif file.stat().st_size < end:
            problems.append(f"data file {file} is truncated ({file.stat().st_size} bytes, metadata needs {end})")
    if problems or not checksums:
        return problems
    buffer = memoryview(bytearray(1 << 20))
    for name in sorted(records, key=lambda n: (len(n), n))[rank::world]:
        file = path / name
        with open(file, "rb", buffering=0) as fh:
            for offset, length in sorted(records[name]):
                bad = _check_record(fh, offset, length, buffer)
                if bad is not None:
                    problems.append(
                        f"data file {file} is corrupt: the record at bytes {offset}-{offset + length} "
                        f"fails its CRC-32 check ({bad})"
                    )
                    break
    return problems
