"""materialize / load_pretrained / export_hf / dcp_to_hf in one process: guarantees and errors.

The multi-process behaviour (sharded, uneven, 2-D) is in tests/dist/test_weights.py.
"""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from models import TinyGPT
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard
from weights import hf_config, hf_model, pretrained, tokens

import fsdp2kit as fk
from fsdp2kit.checkpoint import CheckpointError
from fsdp2kit.weights.export import parse_size

pytestmark = pytest.mark.timeout(120)


class Rope(nn.Module):
    """A home-made rotary table: its buffer comes from arguments it keeps as attributes."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.dim, self.base = dim, base
        inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv, persistent=False)


class Opaque(nn.Module):
    """A buffer computed from an argument it does not keep: nothing can recompute it."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, n), persistent=False)


class Plain(nn.Module):
    """Only torch layers: construction is their reset_parameters in module order."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 24, padding_idx=3)
        self.rope = Rope(8)
        self.body = nn.Sequential(nn.Linear(24, 32), nn.LayerNorm(32), nn.Linear(32, 24))
        self.head = nn.Linear(24, 50)


def _meta(build):
    with torch.device("meta"):
        return build()


def test_materialize_plain_model_equals_ordinary_construction():
    torch.manual_seed(7)
    cpu = Plain()
    model = _meta(Plain)
    torch.manual_seed(7)
    fk.materialize(model, device="cpu")
    for (name, p), (_, q) in zip(model.state_dict().items(), cpu.state_dict().items()):
        assert torch.equal(p, q), name
    assert torch.equal(model.rope.inv_freq, cpu.rope.inv_freq)
    assert model.emb.weight[3].abs().max() == 0  # nn.Embedding's padding row


def test_materialize_twice_changes_nothing():
    model = fk.materialize(_meta(Plain), device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fk.materialize(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_materialize_transformers_model_replays_its_init_weights():
    torch.manual_seed(3)
    model = fk.materialize(hf_model("llama", meta=True), device="cpu")
    reference = hf_model("llama", meta=True)
    reference.to_empty(device="cpu")
    torch.manual_seed(3)
    reference.initialize_weights()  # what transformers runs on a meta-built model's missing weights
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name
    cpu = hf_model("llama")
    for name, b in model.named_buffers():
        assert torch.equal(b, dict(cpu.named_buffers())[name]), name


def test_materialize_gemma_buffers_and_pad_row():
    model = fk.materialize(hf_model("gemma2", meta=True), device="cpu")
    cpu = hf_model("gemma2")
    emb = model.model.embed_tokens
    assert torch.equal(emb.embed_scale, cpu.model.embed_tokens.embed_scale)
    assert emb.embed_scale.item() == pytest.approx(math.sqrt(40), rel=1e-6)
    assert emb.weight[emb.padding_idx].abs().max() == 0
    assert model.lm_head.weight is emb.weight
    assert torch.isfinite(model(tokens()).logits).all()


def test_materialize_names_parameters_no_init_covers():
    with pytest.raises(ValueError, match=r"\['pos'\]"):
        fk.materialize(_meta(TinyGPT), device="cpu")


def test_materialize_with_init_fn_sees_full_tensors():
    shapes = []

    def init(m: nn.Module) -> None:
        for name, p in m.named_parameters(recurse=False):
            shapes.append((name, tuple(p.shape)))
        if isinstance(m, TinyGPT):
            nn.init.normal_(m.pos, std=0.02)
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            m.reset_parameters()

    model = fk.materialize(_meta(TinyGPT), device="cpu", init_fn=init)
    assert ("pos", (16, 40)) in shapes
    assert model.head.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_materialize_buffers_it_cannot_recompute():
    build = lambda: nn.Sequential(nn.Linear(4, 4), Opaque(5))
    with pytest.raises(ValueError, match=r"cannot recompute buffers \['1.table'\]"):
        fk.materialize(_meta(build), device="cpu")

    def fill(m):
        if isinstance(m, Opaque):
            m.table.copy_(torch.linspace(0, 1, 5))
        elif isinstance(m, nn.Linear):
            m.reset_parameters()

    model = fk.materialize(_meta(build), device="cpu", init_fn=fill)
    assert torch.equal(model[1].table, torch.linspace(0, 1, 5))
    with pytest.raises(ValueError, match=r"left buffers \['1.table'\] unset"):
        fk.materialize(
            _meta(build), device="cpu", init_fn=lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None
        )


class WritesChildDirectly(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def reset_parameters(self):  # reaches a sharded parameter without torch.nn.init
        self.child.weight.data.normal_()


def test_materialize_refuses_init_that_bypasses_the_replay(mesh):
    model = _meta(WritesChildDirectly)
    fk.shard_model(model, mesh)
    with pytest.raises(RuntimeError, match=r"\(root\)'s initialisation calls normal_ on a sharded parameter"):
        fk.materialize(model)


class ScalesChildAfterItsInit(WritesChildDirectly):
    def reset_parameters(self):  # reads a sharded parameter another call initialised: no value to read
        with torch.no_grad():
            self.child.weight.mul_(0.5)


def test_materialize_refuses_init_that_reads_a_sharded_parameter(mesh):
    model = _meta(ScalesChildAfterItsInit)
    fk.shard_model(model, mesh)
    with pytest.raises(RuntimeError, match=r"calls mul_ on a sharded parameter it has not written"):
        fk.materialize(model)


_BOUND_TRUNC_NORMAL = torch.nn.init.trunc_normal_  # bound at import, as transformers' table holds it


class InitsChild(nn.Module):
    """The root initialises its child's weight (torchtitan's output head); the child has no init of its own."""

    def __init__(self, init):
        super().__init__()
        self.init = init
        self.child = nn.Module()
        self.child.weight = nn.Parameter(torch.empty(16, 12))
        self.bias = nn.Parameter(torch.empty(4))

    def reset_parameters(self):
        nn.init.zeros_(self.bias)
        self.init(self.child.weight)


@pytest.mark.parametrize(
    "init",
    [
        lambda w: nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04),  # redraws through empty_like(...).normal_()
        lambda w: nn.init.trunc_normal_(w, std=1.0, a=-0.1, b=0.1),  # the tight-bounds branch: uniform_ and where
        lambda w: _BOUND_TRUNC_NORMAL(w, std=1.0, a=-0.1, b=0.1),  # not through torch.nn.init's attribute
        lambda w: nn.init.orthogonal_(w, gain=2.0),  # new_empty(...).normal_(), qr, view_as(q).copy_
        nn.init.eye_,  # torch.eye(out=w)
    ],
    ids=["trunc_normal_", "trunc_normal_tight", "trunc_normal_bound", "orthogonal_", "eye_"],
)
def test_materialize_init_of_another_modules_sharded_weight(mesh, init):
    torch.manual_seed(3)
    reference = InitsChild(init)
    reference.reset_parameters()
    torch.manual_seed(3)
    model = _meta(lambda: InitsChild(init))
    fully_shard(model.child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fk.materialize(model)
    assert torch.equal(model.child.weight.full_tensor(), reference.child.weight)
    assert torch.nn.init.trunc_normal_ is _BOUND_TRUNC_NORMAL  # the routing is gone after the call


def test_load_and_export_plain_model(tmp_path):
    torch.manual_seed(0)
    source = Plain()
    save_file(source.state_dict(), tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = _meta(Plain)
    result = fk.load_pretrained(model, tmp_path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), source.state_dict().values()))
    assert torch.equal(model.rope.inv_freq, source.rope.inv_freq)  # not in the file: recomputed
    out = fk.export_hf(model, tmp_path / "out")
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # no config for a plain torch model
    assert load_file(out / "model.safetensors").keys() == source.state_dict().keys()


class WithExtraState(Plain):
    """A module whose state dict carries a non-tensor (get_extra_state), as transformer-engine layers do."""

    def get_extra_state(self):
        return {"version": 1}

    def set_extra_state(self, state):
        pass


def test_load_and_export_skip_extra_state(tmp_path):
    torch.manual_seed(0)
    source = Plain()
    save_file(source.state_dict(), tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = _meta(WithExtraState)
    assert fk.load_pretrained(model, tmp_path).unexpected_keys == []
    out = fk.export_hf(model, tmp_path / "out")
    assert load_file(out / "model.safetensors").keys() == source.state_dict().keys()


def test_export_refuses_to_overwrite(tmp_path):
    model = fk.materialize(_meta(Plain), device="cpu")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        fk.export_hf(model, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out")]  # no partial left behind
    fk.export_hf(model, tmp_path / "out", overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]


def _dcp(model, step_dir: Path, config=None) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": get_model_state_dict(model), "extra": {"step": 1}}, checkpoint_id=str(step_dir), no_dist=True
        )
    if config is not None:
        config.save_pretrained(step_dir)


def test_dcp_to_hf_picks_the_newest_complete_step(tmp_path):
    torch.manual_seed(0)
    old, new = hf_model("llama"), hf_model("llama")
    _dcp(old, tmp_path / "step_00000002", old.config)
    _dcp(new, tmp_path / "step_00000010", new.config)
    (tmp_path / "step_00000011").mkdir()  # a save that never finished: no .metadata
    out = fk.dcp_to_hf(tmp_path, tmp_path / "hf", max_shard_size="60KB")
    assert (out / "model.safetensors.index.json").is_file()
    back = pretrained(out)
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, new(tokens()).logits)


def test_dcp_to_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        fk.dcp_to_hf(tmp_path / "nope", tmp_path / "hf")
    (tmp_path / "root").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a DCP checkpoint"):
        fk.dcp_to_hf(tmp_path / "root", tmp_path / "hf")
    model = hf_model("llama")
    _dcp(model, tmp_path / "root" / "step_00000001")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        fk.dcp_to_hf(tmp_path / "root", tmp_path / "hf")
    with pytest.raises(ValueError, match=r"not match GPT2LMHeadModel.*missing from the checkpoint: transformer.wpe"):
        fk.dcp_to_hf(tmp_path / "root", tmp_path / "hf", config=hf_config("gpt2"))
    wide = hf_config("llama")
    wide.intermediate_size = 64
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight: checkpoint \(56, 40\)"):
        fk.dcp_to_hf(tmp_path / "root", tmp_path / "hf", config=wide)
    assert not (tmp_path / "hf").exists()


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_dcp_metadata_is_not_unpickled_blindly(tmp_path):
    model = hf_model("llama")
    step = tmp_path / "step_00000001"
    _dcp(model, step, model.config)
    (step / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match="refusing to load (posix|os).system"):
        fk.dcp_to_hf(step, tmp_path / "hf")


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 5 * 10**8
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size(123) == 123
    with pytest.raises(ValueError):
        parse_size("lots")
