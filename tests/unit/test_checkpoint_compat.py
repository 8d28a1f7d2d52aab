"""Checkpoint format 2 (optimizer hyper-parameters once per param group) and format 1 compatibility.

tests/dist/fixtures/ckpt_format1 was written at 2 ranks by the Checkpointer of tag layout-v2
(format 1: every hyper-parameter of every parameter a pickled record of its own; see
make_ckpt_format1.py). It must still load, here resharded to a world of one, into a plain and
an FSDP-sharded model; saving it again writes format 2, which loads to the same bits and which
DCP's own tools read without fsdp2kit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from ckpt_cases import snapshot
from fixtures.make_ckpt_format1 import tiny_model
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsdp2kit as fk
from fsdp2kit.checkpoint import Checkpointer, read_metadata, step_dir
from fsdp2kit.checkpoint.optim import optimizer_format

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).resolve().parent.parent / "dist" / "fixtures" / "ckpt_format1"


def _fresh(sharded: bool, mesh):
    torch.manual_seed(123)  # other weights than the checkpoint's
    model = tiny_model()
    for p in model.parameters():
        torch.nn.init.normal_(p)
    if sharded:
        fk.shard_model(model, mesh)
    # other hyper-parameters too: they must come from the checkpoint
    return model, torch.optim.AdamW(model.parameters(), lr=5.0, betas=(0.5, 0.5), weight_decay=0.0)


def _assert_same(snap: dict, expected: dict) -> None:
    assert set(snap["model"]) == set(expected["model"])
    for k, v in expected["model"].items():
        assert torch.equal(snap["model"][k], v), k
    assert set(snap["optim"]) == set(expected["optim"])
    for k, v in expected["optim"].items():
        got = snap["optim"][k]
        if isinstance(v, torch.Tensor):
            assert got.dtype == v.dtype and torch.equal(got, v), k
        else:
            assert got == v and type(got) is type(v), k


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp"])
def test_format1_loads_and_resaves_as_format2(mesh, tmp_path, sharded):
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    expected = torch.load(root / "expected.pt", weights_only=True)
    assert optimizer_format(read_metadata(step_dir(root, 3))) == 1

    model, opt = _fresh(sharded, mesh)
    ck = Checkpointer(root, keep_last=None, rng=False)
    assert ck.load(model, optimizer=opt) == 3
    _assert_same(snapshot(model, opt), expected)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert ck.loaded_extra == {"schedule": {"lr": 0.01, "milestones": (1, 2)}, "position": {"rank": 0}}

    ck.save(4, model, optimizer=opt, extra={"schedule": ck.loaded_extra["schedule"]})
    old, new = read_metadata(step_dir(root, 3)), read_metadata(step_dir(root, 4))
    assert optimizer_format(new) == 2
    keys = set(new.state_dict_metadata)
    assert "optimizer.packed.json" in keys and not any(k.startswith("optimizer.param_groups.") for k in keys)
    # the same tensors under the same names: what resharding on load works from
    tensors = {k for k in old.state_dict_metadata if k.startswith(("model.", "optimizer.state.")) and "step" not in k}
    assert tensors <= keys
    n_old = sum(k.startswith("optimizer.") for k in old.state_dict_metadata)
    n_new = sum(k.startswith("optimizer.") for k in keys)
    assert n_new < n_old / 3, (n_new, n_old)

    model2, opt2 = _fresh(sharded, mesh)
    assert ck.load(model2, optimizer=opt2) == 4
    _assert_same(snapshot(model2, opt2), expected)


def test_format2_is_plain_dcp(mesh, tmp_path):
    """DCP's own converter reads a format-2 step without fsdp2kit's help."""
    model, opt = _fresh(True, mesh)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    Checkpointer(tmp_path, rng=False).save(1, model, optimizer=opt)
    out = tmp_path / "all.pt"
    dcp_to_torch_save(step_dir(tmp_path, 1), out)
    flat = torch.load(out, weights_only=True)
    assert torch.equal(flat["model"]["tok.weight"], model.tok.weight.full_tensor())
    exp_avg = opt.state[model.tok.weight]["exp_avg"].full_tensor()
    assert torch.equal(flat["optimizer"]["state"]["tok.weight"]["exp_avg"], exp_avg)
    assert flat["optimizer"]["packed"]["json"].dtype == torch.uint8


def test_unknown_future_format_is_refused(mesh, tmp_path):
    from fsdp2kit.checkpoint import optim
    from fsdp2kit.checkpoint.extras import encode

    model, opt = _fresh(False, mesh)
    packed = {"format": 3, "param_groups": [], "scalars": {}, "values": {}}
    with pytest.raises(ValueError, match="format 3, which this fsdp2kit"):
        optim.restore_optimizer(model, opt, {"state": {}, "packed": encode(packed, "test")})
