"""Checkpoint parts that need no peers: the directory layout, how `extra` is stored, RNG states,
refusing pickled code, argument errors, and a save/load in a world of one (this process) or in
no process group at all (a subprocess).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from models import build

from fsdp2kit.checkpoint import (
    Checkpointer,
    CheckpointError,
    RNGState,
    incomplete_dirs,
    list_steps,
    read_metadata,
    step_dir,
)
from fsdp2kit.checkpoint.extras import decode, encode
from fsdp2kit.checkpoint.unpickler import SafeLoadPlanner

pytestmark = pytest.mark.timeout(60)


def test_layout(tmp_path):
    assert list_steps(tmp_path / "absent") == [] and incomplete_dirs(tmp_path / "absent") == []
    assert step_dir(tmp_path, 100) == tmp_path / "step_00000100"
    assert step_dir(tmp_path, 123456789).name == "step_123456789"
    for step in (100, 7, 123456789):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / ".metadata").write_bytes(b"")
    (tmp_path / "step_00000200").mkdir()  # no .metadata: not complete
    (tmp_path / ".tmp-step_00000300-abcd").mkdir()
    (tmp_path / ".trash-step_00000001-abcd").mkdir()
    (tmp_path / "step_xx").mkdir()
    (tmp_path / "step_00000400").write_text("a file, not a directory")
    assert list_steps(tmp_path) == [7, 100, 123456789]
    assert [p.name for p in incomplete_dirs(tmp_path)] == [
        ".tmp-step_00000300-abcd",
        ".trash-step_00000001-abcd",
        "step_00000200",
    ]


@pytest.mark.parametrize("bad", [-1, 1.0, "3", True, None])
def test_bad_steps(tmp_path, bad):
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        step_dir(tmp_path, bad)


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_bad_keep_last(tmp_path, bad):
    with pytest.raises(ValueError, match="keep_last must be None"):
        Checkpointer(tmp_path, keep_last=bad)


def test_extra_roundtrip():
    value = {
        "ints": [1, -2, 10**20],
        "floats": [0.1, 1e-300, float("inf"), -0.0],
        "plain": {"a": None, "b": True, "c": "text", "nested": {"d": [[]]}},
        "tuple": (1, (2, 3), []),
        "odd_keys": {1: "one", (2, 3): "pair", "__dunder": "kept", None: 0},
        "tensor": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
        "array": np.arange(4, dtype=np.int32),
        "np_scalar": np.float64(2.5),
    }
    entry = encode(value, "extra['x']")
    assert entry["json"].dtype == torch.uint8 and set(entry["tensors"]) == {"0", "1"}
    back = decode(entry)
    assert torch.equal(back.pop("tensor"), value.pop("tensor"))
    array = back.pop("array")
    assert array.dtype == np.int32 and np.array_equal(array, value.pop("array"))
    assert back == value
    assert math.copysign(1.0, back["floats"][3]) == -1.0
    assert math.isnan(decode(encode(float("nan"), "x")))


def test_extra_stateful_object_is_stored_by_its_state():
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), step_size=3)
    assert decode(encode(sched, "extra['sched']")) == sched.state_dict()


@pytest.mark.parametrize(
    "value,where,what",
    [
        ({"fn": [1, lambda: 0]}, "extra['k']['fn'][1]", "is a function"),
        ({"s": {1, 2}}, "extra['k']['s']", "is a set"),
        ([RNGState()], "extra['k'][0]", "put it at the top level of extra"),
    ],
)
def test_extra_refuses_what_it_cannot_store(value, where, what):
    with pytest.raises(TypeError) as info:
        encode(value, "extra['k']")
    assert where in str(info.value) and what in str(info.value)


def test_rng_state_roundtrip():
    def draws():
        return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(), np.random.randn()

    np.random.randn()  # leaves a cached Gaussian in NumPy's state, which must come back too
    saved = decode(encode(RNGState(), "rng"))
    first = draws()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    RNGState().load_state_dict(saved)
    assert draws() == first


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_reader_refuses_code(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        read_metadata(tmp_path)
    assert not marker.exists()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="not DCP metadata .it holds a dict"):
        read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match="is corrupt or not DCP metadata"):
        read_metadata(tmp_path)
    with pytest.raises(CheckpointError, match="has no .metadata"):
        read_metadata(tmp_path / "nowhere")


def test_non_tensor_values_are_read_weights_only(tmp_path):
    """DCP stores non-tensor values (optimizer hyper-parameters) as small pickles and its default
    planner reads them with weights_only=False; ours must refuse one that names a function."""
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        planner.load_bytes(SimpleNamespace(dest_index=SimpleNamespace(fqn="x")), buf)
    assert not marker.exists()
    buf = io.BytesIO()
    torch.save((0.9, 0.999), buf)
    buf.seek(0)
    planner.load_bytes(SimpleNamespace(dest_index=SimpleNamespace(fqn="betas")), buf)
    assert planner.state_dict == {"betas": (0.9, 0.999)}


def test_save_argument_errors(tmp_path):
    ck = Checkpointer(tmp_path)
    model = build("tinygpt")
    with pytest.raises(TypeError, match="extra must be a dict"):
        ck.save(1, model, extra=[1])
    with pytest.raises(ValueError, match="extra keys must be non-empty strings not starting with '__'"):
        ck.save(1, model, extra={"__rng__": 1})
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        ck.load(model, step=-1)
    assert not tmp_path.joinpath("step_00000001").exists()


def test_world_of_one_in_process(mesh, tmp_path):
    """Plain (unsharded) model and optimizer in this process's world of one."""
    model = build("tinygpt")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    ck = Checkpointer(tmp_path, keep_last=None)
    assert ck.load(model) is None
    ck.save(3, model, optimizer=opt, extra={"epoch": 2})
    other = build("tinygpt", seed=1)
    other_opt = torch.optim.Adam(other.parameters(), lr=5.0)
    assert ck.load(other, optimizer=other_opt) == 3
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert other_opt.param_groups[0]["lr"] == 1e-3
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    assert ck.loaded_extra == {"epoch": 2}
    assert ck.steps == [3]

    # An RNGState in extra is per rank whether wrapped in PerRank or not.
    ck.save(4, model, extra={"rng": RNGState()})
    keys = set(read_metadata(step_dir(tmp_path, 4)).state_dict_metadata)
    assert "extra.rank.0.rng.json" in keys and not any(k.startswith("extra.shared.") for k in keys)


_NO_GROUP = textwrap.dedent(
    """
    import sys, warnings, torch
    import torch.distributed as dist
    from fsdp2kit.checkpoint import Checkpointer
    from models import build
    warnings.simplefilter("error")  # no "assuming single process" warnings either
    model = build("tinygpt")
    for ck in (Checkpointer(sys.argv[1]), Checkpointer(sys.argv[1], async_save=True)):
        ck.save(1, model, extra={"k": [1, 2]})
        ck.wait()
        other = build("tinygpt", seed=4)
        assert ck.load(other) == 1 and ck.loaded_extra == {"k": [1, 2]}
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
        ck.close()
    assert not dist.is_initialized()
    print("ok")
    """
)


def test_no_process_group(tmp_path):
    """Without any process group (a notebook, a conversion script) saving and loading still work."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), str(Path(__file__).parents[1])]))
    done = subprocess.run(
        [sys.executable, "-c", _NO_GROUP, str(tmp_path)], capture_output=True, text=True, env=env, timeout=50
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
