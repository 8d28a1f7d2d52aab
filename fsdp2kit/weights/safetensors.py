"""Reading safetensors files a rank at a time: the index, the headers, and only the rows a shard needs."""

from __future__ import annotations

import json
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
    probe = SafetensorsReader({})
    return {k: path for path in candidates for k in probe.header(path)[1] if k != "__metadata__"}


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
}  # fmt: skip


class SafetensorsReader:
    """Reads tensors, or only the rows a rank needs, from safetensors files with plain file reads.

    A safetensors file is an 8-byte header length, a JSON header (dtype, shape and byte range of
    every tensor) and the raw row-major data, so rows ``[a, b)`` of a tensor are one contiguous
    byte range: we read exactly that, straight into the destination when the dtypes agree.
    Reading with ``readinto`` rather than through a memory map keeps the checkpoint's page-cache
    pages out of the process (a mapped file counts in its resident set for as long as it is
    mapped), so a rank's memory during the load is its shards and one tensor's rows, no more.
    """

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.headers: dict[Path, tuple[int, dict]] = {}
        self.handles: dict[Path, object] = {}
        self.bytes = 0

    def header(self, path: Path) -> tuple[int, dict]:
        """(byte offset of the data, the JSON header) of one file."""
        if path not in self.headers:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
                n = int.from_bytes(head, "little")
                if n > 100_000_000 or n > path.stat().st_size - 8:
                    raise ValueError(f"{path} is not a safetensors file (header length {n})")
                self.headers[path] = (8 + n, json.loads(f.read(n)))
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
        """The tensor ``key``, or ``key[index]``; with ``into``, copied into that tensor (returned)."""
        path, data_start, entry = self.entry(key)
        shape, dtype = self.shape(key), self.dtype(key)
        begin, end = entry["data_offsets"]
        rows = index[0].indices(shape[0]) if index and shape else (0, shape[0] if shape else 1, 1)
        row_bytes = (end - begin) // max(shape[0], 1) if shape else end - begin
        first, last = rows[0], max(rows[0], rows[1])
        part_shape = (last - first, *shape[1:]) if shape else ()
        rest = tuple(index[1:]) if index else ()
        whole_rows = all(s.indices(n) == (0, n, 1) for s, n in zip(rest, shape[1:]))
        if len(shape) == 2 and not whole_rows and rest[0].indices(shape[1])[2] == 1:
            # A column block (a row-wise tensor-parallel split): read each row's own columns
            # instead of whole rows, so a rank reads its TP x FSDP slice and nothing more.
            return self._read_columns(key, path, data_start + begin, (first, last), rest[0], into)
        direct = (
            into is not None
            and whole_rows
            and into.dtype == dtype
            and into.is_contiguous()
            and into.device.type == "cpu"
        )
        buf = into if direct else torch.empty(part_shape, dtype=dtype)
        nbytes = (last - first) * row_bytes
        if tuple(buf.shape) != part_shape:
            raise RuntimeError(
                f"internal: {key} rows {first}:{last} have shape {part_shape}, destination {tuple(buf.shape)}"
            )
        if nbytes:
            view = (
                memoryview(buf.view(torch.uint8).reshape(-1).numpy())
                if buf.dim()
                else memoryview(buf.reshape(1).view(torch.uint8).numpy())
            )
            if path not in self.handles:
                self.handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
            f = self.handles[path]
            f.seek(data_start + begin + first * row_bytes)
            done = 0
            while done < nbytes:
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"{path} ends inside {key}: the file is truncated")
                done += got
        self.bytes += nbytes
        part = buf if whole_rows else buf[(slice(None), *rest)]
        if into is not None and not direct:
            into.copy_(part)
            return into
        return part

    def _read_columns(
        self, key: str, path: Path, start: int, rows: tuple[int, int], cols: slice, into: torch.Tensor | None
    ) -> torch.Tensor:
        shape, dtype = self.shape(key), self.dtype(key)
        c0, c1, _ = cols.indices(shape[1])
        c1 = max(c0, c1)
        elem = dtype.itemsize
        direct = into is not None and into.dtype == dtype and into.is_contiguous() and into.device.type == "cpu"
        buf = into if direct else torch.empty((rows[1] - rows[0], c1 - c0), dtype=dtype)
        width = (c1 - c0) * elem
        if width and buf.numel():
            if path not in self.handles:
                self.handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
            f = self.handles[path]
            view = memoryview(buf.view(torch.uint8).reshape(-1).numpy())
            for i, r in enumerate(range(rows[0], rows[1])):
                f.seek(start + (r * shape[1] + c0) * elem)
                done = 0
                while done < width:
                    got = f.readinto(view[i * width + done : (i + 1) * width])
                    if not got:
                        raise ValueError(f"{path} ends inside {key}: the file is truncated")
                    done += got
        self.bytes += width * (rows[1] - rows[0])
        if into is not None and not direct:
            into.copy_(buf)
            return into
        return buf

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()
