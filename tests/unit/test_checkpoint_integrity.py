"""Record checksums: torch.save's CRC-32 stays on while the Checkpointer writes, and `verify_files`
finds what torch.load does not (a flipped byte, a garbled archive) and skips what cannot be checked.
Multi-rank cases (every rank raises, the model untouched): tests/dist/test_checkpoint.py."""

from __future__ import annotations

import io
import threading
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from fsdp2kit.checkpoint import Checkpointer, incomplete_dirs, list_steps, read_metadata, step_dir
from fsdp2kit.checkpoint.checks import verify_files

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _save(path, crc: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g).bfloat16(), "hp": {"lr": 0.1}}
    saved = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)  # the test's own scope: a writer with checksums off
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(saved)
    return state


def _record(path, key: str):
    info = read_metadata(path).storage_data
    return next(v for k, v in info.items() if k.fqn == key)


def _flip(path, at: int) -> None:
    file = path / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def test_flipped_tensor_byte_is_found_where_torch_load_reads_it_silently(tmp_path):
    state = _save(tmp_path)
    assert verify_files(read_metadata(tmp_path), tmp_path) == []
    w = _record(tmp_path, "w")
    _flip(tmp_path, w.offset + w.length // 2)  # the middle of an 8 KB tensor's record: its bytes
    back = {"w": torch.zeros(64, 32), "b": torch.zeros(7).bfloat16(), "hp": {"lr": None}}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path), no_dist=True)  # torch.load checks nothing
    assert not torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    problems = verify_files(read_metadata(tmp_path), tmp_path)
    assert len(problems) == 1 and "__0_0.distcp is corrupt" in problems[0] and "data/0: CRC-32 0x" in problems[0]
    assert f"bytes {w.offset}-{w.offset + w.length}" in problems[0]


def test_garbled_archive_and_shares(tmp_path):
    _save(tmp_path)
    b = _record(tmp_path, "b")
    _flip(tmp_path, b.offset + b.length - 22)  # the signature of the archive's end record: not a zip any more
    problems = verify_files(read_metadata(tmp_path), tmp_path)
    assert len(problems) == 1 and "BadZipFile" in problems[0]
    # a rank with no file in its share (rank 1 of 2, one file) checks nothing
    assert verify_files(read_metadata(tmp_path), tmp_path, rank=1, world=2) == []


def test_records_written_without_crc_are_skipped(tmp_path):
    _save(tmp_path, crc=False)
    w = _record(tmp_path, "w")
    with zipfile.ZipFile((tmp_path / "__0_0.distcp").open("rb")) as z:  # (zipfile finds the last record)
        assert all(i.CRC == 0 for i in z.infolist())
    _flip(tmp_path, w.offset + w.length // 2)
    assert verify_files(read_metadata(tmp_path), tmp_path) == []  # nothing to check against


@pytest.mark.parametrize("async_save", [False, True])
def test_crc32_stays_on_during_and_after_a_save(mesh, tmp_path, monkeypatch, async_save):
    """The writer never turns torch.save's checksums off, in its own thread or the caller's, and
    the records carry them."""
    seen, entered, release = [], threading.Event(), threading.Event()
    original = FileSystemWriter.write_data

    def observing(self, plan, planner):
        seen.append(("writer", torch.serialization.get_crc32_options()))
        entered.set()
        if async_save:
            release.wait(timeout=30)  # the caller looks while this write is in flight
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", observing)
    model = torch.nn.Linear(8, 4)
    ck = Checkpointer(tmp_path, async_save=async_save)
    ck.save(1, model)
    assert entered.wait(timeout=30)
    seen.append(("caller", torch.serialization.get_crc32_options()))
    release.set()
    ck.close()
    seen.append(("after", torch.serialization.get_crc32_options()))
    assert seen == [("writer", True), ("caller", True), ("after", True)]
    step = step_dir(tmp_path, 1)
    w = _record(step, "model.weight")
    with open(step / w.relative_path, "rb") as fh:
        fh.seek(w.offset)
        with zipfile.ZipFile(io.BytesIO(fh.read(w.length))) as z:
            assert all(i.CRC != 0 for i in z.infolist() if i.file_size)


@pytest.mark.parametrize("async_save", [False, True])
def test_pruned_steps_deleted_in_background(mesh, tmp_path, async_save):
    """keep_last renames old steps away at once and deletes them on a thread; wait() joins it."""
    model = torch.nn.Linear(4, 3)
    ck = Checkpointer(tmp_path, keep_last=1, async_save=async_save)
    for step in (1, 2, 3):
        ck.save(step, model)
        if not async_save:
            assert list_steps(tmp_path) == [step]  # published and pruned before save returns
    ck.wait()
    assert list_steps(tmp_path) == [3] and incomplete_dirs(tmp_path) == []
    model2 = torch.nn.Linear(4, 3)
    assert ck.load(model2) == 3 and torch.equal(model2.weight, model.weight)
    ck.close()
