"""Reading DCP's tensor records straight into the tensors being loaded, one copy from the file instead of three.

DCP stores every tensor record as a small ``torch.save`` archive inside the rank's ``.distcp``
file. Its `FileSystemReader` loads each record with ``torch.load`` (which allocates a fresh
tensor and copies the bytes into it), narrows it to the part this rank needs, and copies that
into the destination tensor: two copies and a fresh allocation (page faults) for every byte, on
top of Python's file view that reads through small buffers. For a record whose bytes can be
located exactly, `DirectReader` instead reads the archive's table of contents and its tiny
pickle, and reads the wanted byte range with one ``readinto`` into the destination's own memory.

The fast path is taken only when nothing can differ from what ``torch.load`` would give:

- the archive holds one plain dense tensor (``_rebuild_tensor_v2`` of one storage, stored
  uncompressed, in this machine's byte order) of the destination's dtype, laid out row-major;
- the part to read is one contiguous byte range of it (rows of a row-major tensor: how FSDP
  shards, along dimension 0, so resharding a checkpoint to another world size stays on the
  fast path);
- the destination is a contiguous CPU tensor of exactly that shape.

Anything else (another layout, a transform extension, a GPU destination, a format this parser
does not know) goes through DCP's own reader, record by record. The checkpoint format does not
change: this reads the files DCP writes, and DCP's tools keep reading them too.
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import pickle
import struct
import sys
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["DirectReader"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header, 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"
_CENTRAL = struct.Struct("<4s6H3I5H2I")  # a central directory entry, 46 bytes
_CENTRAL_MAGIC = b"PK\x01\x02"
_EOCD = struct.Struct("<4s4H2IH")  # the end of central directory record, 22 bytes
_EOCD_MAGIC = b"PK\x05\x06"
_TAIL = 4096  # bytes read from a record's end: its central directory and end records


@dataclass(frozen=True)
class _Record:
    """Where a stored tensor's bytes are in the file, and how they are laid out."""

    data_start: int  # absolute file offset of the tensor's first element
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Unsupported(Exception):
    """This record is not one the fast path reads; DCP's reader takes it."""


class _Slice(io.RawIOBase):
    """A read-only, seekable window ``[start, start + length)`` of an open file (what zipfile needs)."""

    def __init__(self, fh: io.FileIO, start: int, length: int):
        super().__init__()
        self._fh, self._start, self._length, self._pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        want = max(0, min(len(buffer), self._length - self._pos))
        if not want:
            return 0
        got = os.preadv(self._fh.fileno(), [memoryview(buffer)[:want]], self._start + self._pos)
        self._pos += got
        return got


@functools.cache
def _storage_dtype(name: str) -> torch.dtype:
    cls = getattr(torch, name, None)
    if not (isinstance(cls, type) and name.endswith("Storage")):
        raise _Unsupported(f"storage class torch.{name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation warning: only its dtype is read
        dtype = getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise _Unsupported(f"storage class torch.{name}")
    return dtype


def _rebuild(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride))


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a tensor record's ``data.pkl`` into its layout, creating nothing: an allow-list of
    the three globals a plain tensor's pickle names; anything else means "not a plain tensor"."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return ("storage_class", _storage_dtype(name))
        raise _Unsupported(f"{module}.{name} in a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Unsupported("a persistent id other than a storage")
        _, storage_class, key, _location, numel = pid
        if not (isinstance(storage_class, tuple) and storage_class[0] == "storage_class"):
            raise _Unsupported("an untyped storage")
        return (storage_class[1], str(key), int(numel))


class _Window:
    """Small reads of one record, served from one buffered chunk at a time (a record's headers are
    a few hundred bytes apart, its tensor bytes are skipped without being read)."""

    CHUNK = 4096

    def __init__(self, fh: io.FileIO, offset: int, length: int):
        self._fd, self._offset, self._length = fh.fileno(), offset, length
        self._start, self._buf = 0, b""

    def get(self, rel: int, n: int) -> bytes:
        if rel < 0 or rel + n > self._length:
            raise _Unsupported("an entry runs past the record")
        if not (self._start <= rel and rel + n <= self._start + len(self._buf)):
            self._start = rel
            self._buf = os.pread(self._fd, min(max(n, self.CHUNK), self._length - rel), self._offset + rel)
        return self._buf[rel - self._start : rel - self._start + n]


def _central_directory(fh: io.FileIO, offset: int, length: int) -> list[tuple[str, int, int, int]] | None:
    """``(name, local header offset, compressed size, compression)`` of every entry, parsed from one
    read of the record's tail; None when that read does not hold a plain (non-zip64, no comment)
    end record and the whole central directory, which zipfile then parses instead. A record of
    a few hundred bytes of directory costs zipfile's generic parser about half a millisecond,
    most of a small tensor's load time."""
    tail_len = min(length, _TAIL)
    tail = os.pread(fh.fileno(), tail_len, offset + length - tail_len)
    if len(tail) < _EOCD.size or tail[-_EOCD.size : -_EOCD.size + 4] != _EOCD_MAGIC:
        return None
    _, disk, cd_disk, n_here, n_total, cd_size, cd_offset, comment = _EOCD.unpack(tail[-_EOCD.size :])
    if disk or cd_disk or comment or n_here != n_total or 0xFFFF in (n_here, n_total) or cd_offset == 0xFFFFFFFF:
        return None
    start = cd_offset - (length - tail_len)
    if start < 0 or start + cd_size > tail_len - _EOCD.size:
        return None
    out, pos = [], start
    for _ in range(n_total):
        if pos + _CENTRAL.size > start + cd_size:
            return None
        f = _CENTRAL.unpack(tail[pos : pos + _CENTRAL.size])
        if f[0] != _CENTRAL_MAGIC or 0xFFFFFFFF in (f[8], f[9], f[16]):
            return None  # zip64 sizes or offsets: zipfile reads those
        name_end = pos + _CENTRAL.size + f[10]
        out.append((tail[pos + _CENTRAL.size : name_end].decode("utf-8"), f[16], f[8], f[4]))
        pos = name_end + f[11] + f[12]
    return out


def _entries(fh: io.FileIO, offset: int, length: int) -> tuple[dict[str, tuple[int, int, int]], _Window]:
    """The archive's entries, ``name -> (data offset in the record, size, compression)``, from its
    central directory (torch.save defers each entry's sizes to a data descriptor after its data,
    so the local headers alone cannot be walked)."""
    infos = _central_directory(fh, offset, length)
    if infos is None:
        try:
            archive = zipfile.ZipFile(_Slice(fh, offset, length))
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise _Unsupported(f"not a zip archive ({e})") from e
        infos = [(i.filename, i.header_offset, i.compress_size, i.compress_type) for i in archive.infolist()]
    window = _Window(fh, offset, length)
    entries = {}
    for name, header_offset, size, compression in infos:
        fields = _LOCAL_HEADER.unpack(window.get(header_offset, _LOCAL_HEADER.size))
        if fields[0] != _LOCAL_MAGIC:
            raise _Unsupported("bad local header")
        data = header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        entries[name.split("/", 1)[-1]] = (data, size, compression)
    return entries, window


def _parse_record(fh: io.FileIO, offset: int, length: int) -> _Record:
    """The layout of the tensor archived at ``[offset, offset + length)`` of ``fh``."""
    entries, window = _entries(fh, offset, length)

    def content(name: str) -> bytes:
        if name not in entries or entries[name][2] != zipfile.ZIP_STORED:
            raise _Unsupported(f"no stored {name} entry")
        start, size, _ = entries[name]
        return window.get(start, size)

    if content("byteorder").decode() != sys.byteorder:
        raise _Unsupported("another byte order")
    try:
        layout = _LayoutUnpickler(io.BytesIO(content("data.pkl"))).load()
    except _Unsupported:
        raise
    except Exception as e:  # a pickle this parser does not follow: DCP's reader will
        raise _Unsupported(f"data.pkl ({type(e).__name__}: {e})") from e
    if not (isinstance(layout, tuple) and len(layout) == 5 and layout[0] == "tensor"):
        raise _Unsupported("data.pkl is not a single tensor")
    _, (dtype, key, numel), storage_offset, size, stride = layout
    entry = entries.get(f"data/{key}")
    if entry is None or entry[2] != zipfile.ZIP_STORED or entry[1] != numel * dtype.itemsize:
        raise _Unsupported("storage entry missing, compressed or of another size")
    if entry[0] + entry[1] > length:
        raise _Unsupported("the storage runs past the record")
    if not _row_major(size, stride):
        raise _Unsupported("a strided (non row-major) tensor")
    if (storage_offset + _numel(size)) * dtype.itemsize > entry[1]:
        raise _Unsupported("the tensor runs past its storage")
    return _Record(offset + entry[0] + storage_offset * dtype.itemsize, dtype, size, stride)


def _numel(size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _row_major(size, stride) -> bool:
    if len(size) != len(stride):
        return False
    expected = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def _byte_range(record: _Record, offsets, lengths) -> tuple[int, int]:
    """``(start, nbytes)`` of the region ``offsets``/``lengths`` of the record, when contiguous."""
    size = record.size
    if len(offsets) != len(size) or len(lengths) != len(size):
        raise _Unsupported("rank mismatch")
    for o, n, s in zip(offsets, lengths, size):
        if o < 0 or n < 0 or o + n > s:
            raise _Unsupported("region outside the record")
    # One range when the last dimension read in part may be sliced anywhere, every dimension
    # before it is read at length one, and (by construction) every one after it in full.
    partial = [d for d, (n, s) in enumerate(zip(lengths, size)) if n != s]
    if partial and any(lengths[d] != 1 for d in range(partial[-1])):
        raise _Unsupported("a region that is not one contiguous range")
    start = sum(o * st for o, st in zip(offsets, record.stride)) * record.dtype.itemsize
    return record.data_start + start, _numel(lengths) * record.dtype.itemsize


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype, bfloat16 included)."""
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def _read_exactly(fh: io.FileIO, view: memoryview, start: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fh.fileno(), [view[done:]], start + done)
        if got <= 0:
            raise OSError(f"unexpected end of {fh.name} at byte {start + done}")
        done += got


class DirectReader(FileSystemReader):
    """DCP's `FileSystemReader`, reading tensor records straight into the destination tensors.

    A drop-in replacement: same checkpoints, same planner interface. Counts what it did in
    ``direct_reads`` and ``fallback_reads`` (records), for tests and benchmarks.
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.direct_reads = 0
        self.fallback_reads = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        fallback: list[ReadItem] = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                fallback.append(item)
            else:
                per_file.setdefault(info.relative_path, []).append(item)
        for relative_path, items in per_file.items():
            items.sort(key=lambda it: self.storage_data[it.storage_index].offset)  # read in file order
            with open(self.fs.concat_path(self.path, relative_path), "rb", buffering=0) as fh:
                records: dict[Any, _Record | None] = {}
                for item in items:
                    if not self._read_direct(fh, item, planner, records):
                        fallback.append(item)
        self.fallback_reads += len(fallback)
        if fallback:
            return super().read_data(LoadPlan(fallback), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_direct(self, fh: io.FileIO, item: ReadItem, planner: LoadPlanner, records: dict) -> bool:
        info = self.storage_data[item.storage_index]
        key = (info.offset, info.length)
        if key not in records:
            try:
                records[key] = _parse_record(fh, info.offset, info.length)
            except _Unsupported:
                records[key] = None
        record = records[key]
        if record is None:
            return False
        target = planner.resolve_tensor(item).detach()
        if (
            target.device.type != "cpu"
            or target.dtype != record.dtype
            or not target.is_contiguous()
            or target.is_conj()
            or target.is_neg()
            or tuple(target.shape) != tuple(item.lengths)
        ):
            return False
        try:
            start, nbytes = _byte_range(record, item.storage_offsets, item.lengths)
        except _Unsupported:
            return False
        if nbytes != target.nbytes:
            return False
        if nbytes:
            _read_exactly(fh, _writable_bytes(target), start)
        planner.commit_tensor(item, target)
        self.direct_reads += 1
        return True
