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


def test_low_bit_optimizer_state_is_named_and_guarded(mesh, tmp_path, capsys):
    """inspect names the optimizer and how it held its state (the records are dequantized float32),
    and loading that state into another optimizer is a CheckpointError naming both."""
    import torch.nn as nn

    import fsdp2kit as fk
    from fsdp2kit.checkpoint import CheckpointError

    def model_and(name):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 8))
        fk.shard_model(model, mesh)
        opt = fk.make_optimizer(model, name, lr=1e-3)
        new = getattr(opt, "_new_buffer", lambda p, signed: torch.zeros_like(p))
        for p in model.parameters():  # the state the first step allocates, without compiling torchao's step
            opt.state[p].update(step=torch.tensor(0.0), exp_avg=new(p, True), exp_avg_sq=new(p, False))
        return model, opt

    ck = Checkpointer(tmp_path, keep_last=None)
    model, opt = model_and("adamw8bit")
    ck.save(1, model, optimizer=opt)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "optimizer AdamW8bit" in out
    # the 64 x 128 weight in blocks of 128; the 8 x 64 one (512 elements) and the biases in fp32
    assert "optimizer state in memory (rank 0): 2 OptimState8bit, blocks of 128, 6 float32" in out, out
    for other in ("adamw", "adamw4bit"):
        model, opt = model_and(other)
        with pytest.raises(
            CheckpointError, match=f"state of optimizer AdamW8bit, but .* loaded into {type(opt).__name__}"
        ):
            ck.load(model, optimizer=opt)
    model, opt = model_and("adamw8bit")
    assert ck.load(model, optimizer=opt) == 1
    assert ck.load(model_and("adamw")[0]) == 1  # the model alone, the optimizer afresh
