"""Reading safetensors files a rank at a time: the index, the checked headers, and only the rows a shard needs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def checkpoint_files(hf_dir: Path) -> dict[str, Path]:
    """checkpoint key -> file, from the index of a sharded checkpoint or the single file."""
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"load_pretrained: {hf_dir} is not a directory")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"load_pretrained: {index} has no weight_map")
        files = {k: hf_dir / v for k, v in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"load_pretrained: {index} names files that are not there: {absent}")
        return files
    single = hf_dir / "model.safetensors"
    candidates = [single] if single.is_file() else sorted(hf_dir.glob("*.safetensors"))
    if not candidates:
        found = sorted(p.name for p in hf_dir.iterdir())[:10]
        raise FileNotFoundError(
            f"load_pretrained: no model.safetensors, model.safetensors.index.json or *.safetensors in {hf_dir} "
            f"(found {found}); .bin / .pt checkpoints are not read (they unpickle code): convert them first"
        )
    return SafetensorsReader.of(candidates).files


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
}  # fmt: skip


def read_header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data, {key: dtype, shape, data_offsets}) of one file, checked as safetensors checks it.

    safetensors' own reader refuses a file whose tensors do not tile its data region exactly,
    from byte 0 to the end of the file: a truncated file (a copy cut short) or a padded one is
    an error naming the file here too, found from the header before any tensor is read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 100_000_000):
            raise ValueError(f"{path} is not a safetensors file (header length {n}, file size {size} bytes)")
        text = f.read(n)
    try:
        header = json.loads(text)
        header.pop("__metadata__", None)
        end = 0
        for key, entry in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
            begin, stop = entry["data_offsets"]
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if begin != end or (dtype is not None and stop - begin != math.prod(entry["shape"]) * dtype.itemsize):
                raise ValueError(f"{key}'s data_offsets [{begin}, {stop}] do not follow on from byte {end}")
            end = stop
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a valid safetensors file: {exc!r}") from None
    if 8 + n + end != size:
        what = "truncated" if size < 8 + n + end else "padded with data no tensor holds"
        raise ValueError(f"{path} is {size} bytes, but its header describes {8 + n + end}: the file is {what}")
    return 8 + n, header


class SafetensorsReader:
    """Reads tensors, or only the rows a rank needs, from safetensors files with plain file reads.

    A safetensors file is an 8-byte header length, a JSON header (dtype, shape and byte range of
    every tensor) and the raw row-major data, so rows ``[a, b)`` of a tensor are one contiguous
    byte range: we read exactly that, straight into the destination when the dtypes agree.
    Reading with ``readinto`` rather than through a memory map keeps the checkpoint's page-cache
    pages out of the process and leaves nothing of the model pointing into the file afterwards.
    """

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.headers: dict[Path, tuple[int, dict]] = {}
        self.handles: dict[Path, object] = {}
        self.bytes = 0

    @classmethod
    def of(cls, paths: list[Path]) -> SafetensorsReader:
        """A reader of every tensor of these files (their headers read and checked now)."""
        reader = cls({})
        reader.files = {k: path for path in paths for k in reader.header(path)[1]}
        return reader

    def header(self, path: Path) -> tuple[int, dict]:
        if path not in self.headers:
            self.headers[path] = read_header(path)
        return self.headers[path]

    def entry(self, key: str) -> tuple[Path, int, dict]:
        """(file, byte offset of its data, the key's header entry: dtype, shape, data_offsets)."""
        path = self.files[key]
        start, header = self.header(path)
        if key not in header:
            raise KeyError(f"{key} is not in {path} (the index says it is)")
        return path, start, header[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entry(key)[2]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        name = self.entry(key)[2]["dtype"]
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: safetensors dtype {name} is not supported")
        return SAFETENSORS_DTYPES[name]

    def read(
        self, key: str, index: tuple[slice, ...] | None = None, *, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor ``key``, or ``key[index]``; with ``into``, copied into that tensor (returned).

        ``index`` is a box (one slice per dim, step 1 on dim 0). Its rows are read as one byte
        range; a column block of a 2-D tensor (a row-wise tensor-parallel split) is read row by
        row, so a rank reads its TP x FSDP slice and nothing more.
        """
        path, data_start, entry = self.entry(key)
        shape, dtype = self.shape(key), self.dtype(key)
        rows = shape or (1,)  # a scalar is read as one row
        first, last, _ = (index[0] if index and shape else slice(None)).indices(rows[0])
        last = max(first, last)
        rest = tuple(index[1:]) if index else ()
        sliced = [s.indices(n) for s, n in zip(rest, shape[1:]) if s.indices(n) != (0, n, 1)]
        cols = None
        if len(shape) == 2 and sliced and sliced[0][2] == 1:
            cols = (sliced[0][0], max(sliced[0][0], sliced[0][1]))
            sliced = []
        part_shape = (last - first, *((cols[1] - cols[0],) if cols else shape[1:])) if shape else ()
        direct = into is not None and into.device.type == "cpu" and into.is_contiguous() and into.dtype == dtype
        buf = into if direct and not sliced else torch.empty(part_shape, dtype=dtype)
        if into is not None and tuple(buf[(slice(None), *rest)].shape if sliced else buf.shape) != tuple(into.shape):
            raise RuntimeError(f"internal: {key}[{first}:{last}] does not fit a destination of shape {into.shape}")
        raw = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
        row_bytes = math.prod(rows[1:]) * dtype.itemsize
        start = data_start + entry["data_offsets"][0] + first * row_bytes
        if cols is None:
            self._fill(path, start, raw, key)
        else:
            start, width = start + cols[0] * dtype.itemsize, (cols[1] - cols[0]) * dtype.itemsize
            for i in range(last - first):
                self._fill(path, start + i * row_bytes, raw[i * width : (i + 1) * width], key)
        part = buf[(slice(None), *rest)] if sliced else buf
        if into is None or part is into:
            return part
        return into.copy_(part)

    def _fill(self, path: Path, offset: int, view: memoryview, key: str) -> None:
        if not len(view):
            return
        if path not in self.handles:
            self.handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        f = self.handles[path]
        f.seek(offset)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{path} ends inside {key}: the file was truncated while it was read")
            done += got
        self.bytes += len(view)

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()
