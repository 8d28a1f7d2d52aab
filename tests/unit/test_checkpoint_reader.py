"""DirectReader (tensor records read straight into place) against DCP's own reader, record for record:
every layout it reads itself must give what DCP's reader gives, and every other one must be left to
DCP's reader."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from fsdp2kit.checkpoint.reader import DirectReader
from fsdp2kit.checkpoint.unpickler import SafeReader

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    state = {
        "f32": torch.randn(8, 3, generator=g),
        "bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "i64": torch.arange(10),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "t": base.t(),  # stored strided (DCP keeps a view whose storage is its own size): DCP's reader
        "cols": base[:, 1:3],  # a view into a larger storage: DCP stores a compact copy
        "f16_3d": torch.randn(4, 2, 3, generator=g).half(),
        "bytes": {"lr": 0.1},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path, single_file_per_rank=True), no_dist=True)
    return state


def _empty_like(state):
    return {
        k: (torch.full_like(v.contiguous(), -7) if isinstance(v, torch.Tensor) else {"lr": None})
        for k, v in state.items()
    }


@pytest.mark.parametrize("reader_cls", [DirectReader, SafeReader])
def test_whole_records_match_dcp_reader(tmp_path, reader_cls):
    state = _saved(tmp_path)
    mine, theirs = _empty_like(state), _empty_like(state)
    reader = reader_cls(tmp_path)
    dcp.load(mine, storage_reader=reader, no_dist=True)
    dcp.load(theirs, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine[key], value), key
            assert torch.equal(mine[key], theirs[key]), key
    assert mine["bytes"] == {"lr": 0.1}
    # the strided record ("t") goes through DCP's reader, and "bytes"; DCP plans no read for
    # "empty"; the other six tensors are read directly
    assert reader.direct_reads == 6 and reader.fallback_reads == 2


def test_parts_of_records(tmp_path):
    """Reads of a slice of a record (what resharding asks for): rows of a 2-D record (one byte
    range, direct), columns (not one range: DCP's reader), and a slice of a 3-D record."""
    state = _saved(tmp_path)
    metadata = FileSystemReader(tmp_path).read_metadata()

    def read(key, offsets, lengths):
        dest = {key: torch.full(lengths, -7, dtype=state[key].dtype)}
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dest, metadata, True)
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(key, (0,) * len(lengths)),
            dest_offsets=torch.Size((0,) * len(lengths)),
            storage_index=MetadataIndex(key, (0,) * len(lengths)),
            storage_offsets=torch.Size(offsets),
            lengths=torch.Size(lengths),
        )
        reader = DirectReader(tmp_path)
        reader.set_up_storage_reader(metadata, True)
        reader.read_data(LoadPlan([item]), planner).wait()
        want = state[key][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        assert torch.equal(dest[key], want), (key, offsets, lengths)
        return reader.direct_reads

    assert read("f32", (2, 0), (5, 3)) == 1
    assert read("f32", (0, 1), (8, 2)) == 0
    assert read("f32", (3, 1), (1, 2)) == 1  # one row's part: still one range
    assert read("f16_3d", (1, 0, 0), (2, 2, 3)) == 1
    assert read("f16_3d", (1, 1, 0), (1, 1, 3)) == 1
    assert read("f16_3d", (0, 1, 0), (2, 1, 3)) == 0
    assert read("bf16", (1, 0), (3, 6)) == 1


def test_corrupt_record_raises_like_dcp(tmp_path):
    """A record that is not an archive is left to DCP's reader, whose error surfaces."""
    state = _saved(tmp_path)
    path = next(tmp_path.glob("*.distcp"))
    data = bytearray(path.read_bytes())
    data[: len(data)] = b"\0" * len(data)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException):
        dcp.load(_empty_like(state), storage_reader=DirectReader(tmp_path), no_dist=True)


def test_staging_buffers_are_reused(mesh):
    """The async save's staging copy: reused buffers, a snapshot of the values at stage time,
    DTensors keep their spec around a CPU buffer, a changed shape gets a new buffer."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from fsdp2kit.checkpoint.staging import StagingBuffers

    w = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    state = {"model": {"w": w, "b": torch.ones(3)}, "n": 5, "packed": [torch.tensor(2)]}
    stager = StagingBuffers()
    first = stager.stage(state)
    assert isinstance(first["model"]["w"], DTensor) and first["model"]["w"].placements == w.placements
    assert torch.equal(first["model"]["w"].full_tensor(), w.full_tensor()) and first["n"] == 5
    ptr = first["model"]["w"].to_local().data_ptr()
    assert ptr != w.to_local().data_ptr()  # a copy, not the live tensor
    with torch.no_grad():
        w.to_local().add_(1)
        state["model"]["b"].mul_(3)
    assert torch.equal(first["model"]["b"], torch.ones(3))  # a snapshot
    second = stager.stage(state)
    assert second["model"]["w"].to_local().data_ptr() == ptr  # the same buffer, refreshed
    assert torch.equal(second["model"]["w"].to_local(), w.to_local())
    assert torch.equal(second["model"]["b"], torch.full((3,), 3.0))
    state["model"]["b"] = torch.ones(5)
    del state["packed"]
    third = stager.stage(state)
    assert third["model"]["b"].shape == (5,) and "packed" not in third
    assert len(stager._staged) == 2  # the dropped key's buffer went
    stager.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_pruned_steps_deleted_in_background(mesh, tmp_path, async_save):
    """keep_last renames old steps away at once and deletes them on a thread; wait() joins it."""
    from fsdp2kit.checkpoint import Checkpointer, incomplete_dirs, list_steps

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


def test_writer_without_crc_is_read_by_stock_tools(tmp_path):
    """The Checkpointer's writer skips torch.save's CRC-32: DCP's own reader and torch.load (the
    format utilities) still read every record, and the process-wide option is restored."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fsdp2kit.checkpoint.writer import writer

    state = {"w": torch.randn(5, 4), "step": torch.tensor(3), "b": torch.randn(7).to(torch.bfloat16)}
    before = torch.serialization.get_crc32_options()
    dcp.save(state, storage_writer=writer(tmp_path / "ck"), no_dist=True)
    assert torch.serialization.get_crc32_options() == before
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "ck"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(full[k], v) for k, v in state.items())


@pytest.mark.parametrize("tensor", [torch.arange(3), torch.randn(300, 70), torch.zeros(0), torch.ones(2, 2).bfloat16()])
def test_central_directory_matches_zipfile(tmp_path, tensor):
    """The record parser's own reading of a torch.save archive's directory (one read of its tail)
    agrees with zipfile's, entry for entry; a record it cannot read that way returns None."""
    import zipfile

    from fsdp2kit.checkpoint.reader import _central_directory

    path = tmp_path / "t.pt"
    torch.save(tensor, path)
    pad = b"x" * 100  # a record sits at some offset inside the rank's file
    data = pad + path.read_bytes() + pad
    path.write_bytes(data)
    length = len(data) - 2 * len(pad)
    with open(path, "rb", buffering=0) as fh:
        ours = _central_directory(fh, len(pad), length)
        with zipfile.ZipFile(path.open("rb")) as z:  # zipfile finds the archive despite the padding
            theirs = [(i.filename, i.header_offset, i.compress_size, i.compress_type) for i in z.infolist()]
        assert ours is not None and [o[0] for o in ours] == [t[0] for t in theirs]
        assert [o[2:] for o in ours] == [t[2:] for t in theirs]
        assert _central_directory(fh, len(pad), length - 1) is None  # no end record where expected
