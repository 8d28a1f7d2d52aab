"""A step's integrity: every record's bytes checked against the CRC-32 ``torch.save`` stored with them (which
``torch.load`` never checks), before anything is loaded: docs/checkpoint-format.md ("Integrity")."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

from isal.isal_zlib import crc32
from torch.distributed.checkpoint.metadata import Metadata

CHECKSUMS = "zip-crc32"
"""What ``fsdp2kit.json``'s ``checksums`` says of a step whose records can be verified."""

_CHUNK = 1 << 20
_NAME_LENGTH, _EXTRA_LENGTH = 10, 11  # fields of a local file header (zipfile.structFileHeader)


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file as a file of their own: one record, which
    is a whole zip archive, for ``zipfile`` (which looks for the archive's end at the file's end)."""

    def __init__(self, fh: io.RawIOBase, start: int, length: int):
        super().__init__()
        self._fh, self._start, self._length, self._pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, (0, self._pos, self._length)[whence] + offset)
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._length if n is None or n < 0 else min(self._length, self._pos + n)
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(max(0, end - self._pos))
        self._pos += len(data)
        return data


def _check_record(fh: io.RawIOBase, offset: int, length: int, buffer: memoryview) -> str | None:
    """What is wrong with the archive at ``[offset, offset + length)``, or None. ``zipfile`` reads the
    archive's directory; each entry's bytes are then checked in ``buffer``-sized reads (zipfile's own
    reader costs ~0.1 ms per entry, most of the check for a small record, whose archive has 7)."""
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
    """Every data file the metadata points into exists and is long enough; then (``checksums``) this rank's
    share of them (every ``world``-th, from ``rank``: at the save's world size, the file it wrote) is CRC-checked.
    One problem per bad file, naming it (and the first bad record)."""
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
    buffer = memoryview(bytearray(_CHUNK))
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
