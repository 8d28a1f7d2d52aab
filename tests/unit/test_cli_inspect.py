"""`fsdp2kit inspect`: steps and contents from DCP metadata, without a process group."""

from __future__ import annotations

import json

import pytest
import torch
from models import build

from fsdp2kit.checkpoint import Checkpointer, PerRank
from fsdp2kit.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def root(mesh, tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    model = build("tinygpt")
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(root, keep_last=None)
    ck.save(5, model)
    ck.save(10, model, optimizer=opt, extra={"scheduler": {"epoch": 1}, "data": PerRank({"index": 3})})
    (root / ".tmp-step_00000015-0123abcd").mkdir()
    return root


def test_inspect_newest(root, capsys):
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "complete steps: 5, 10" in out
    assert "incomplete (ignored): .tmp-step_00000015-0123abcd" in out
    assert "step 10:" in out and "optimizer AdamW" in out
    assert "extra: scheduler; per rank: data, rng" in out
    lines = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.startswith(("model.", "optimizer.", "extra."))
    }
    assert lines["model.tok.weight"] == ["(96,", "40)", "float32", "15.0", "KiB"]
    assert lines["optimizer.state.tok.weight.exp_avg"][-3:] == ["float32", "15.0", "KiB"]
    # hyper-parameters once per param group, in one JSON record (checkpoint/optim.py), not per parameter
    assert lines["optimizer.packed.json"][1] == "uint8"
    assert not any(k.startswith("optimizer.param_groups.") for k in lines)
    assert "extra.shared.scheduler.json" in lines and "extra.rank.0.data.json" in lines


def test_inspect_named_step_as_json(root, capsys):
    assert main(["inspect", str(root), "--step", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == [5, 10] and report["step"] == 5
    keys = {e["key"]: e for e in report["contents"]["entries"]}
    assert not any(k.startswith("optimizer.") for k in keys)
    assert keys["model.head.weight"] == {
        "key": "model.head.weight",
        "shape": [96, 40],
        "dtype": "float32",
        "numel": 3840,
        "bytes": 15360,
    }


def test_inspect_a_step_directory(root, capsys):
    assert main(["inspect", str(root / "step_00000005")]) == 0
    out = capsys.readouterr().out
    assert "complete steps" not in out and "step 5:" in out and "model.pos" in out


def test_inspect_errors(root, tmp_path, capsys):
    assert main(["inspect", str(root), "--step", "7"]) == 1
    assert "step 7 is not a complete step" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "absent")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 0
    assert "complete steps: none" in capsys.readouterr().out
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["inspect"])
