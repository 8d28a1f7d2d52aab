"""Meta-device init, pretrained weights into shards, and export back to Hugging Face, on real gloo groups.

One spawn per world size runs every case of that size; each case is asserted on its own.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from weights import KINDS, Case, hf_config, hf_model, pretrained, run_cases, save_references, tokens

from fsdp2kit.testing import run_world

FUSED_BYTES = 2 * (2 * 56 * 40 * 4)  # two layers' gate_up tensors, fp32
LOADS = [Case("load", k) for k in KINDS]
CASES: dict[int, list[Case]] = {
    2: [
        *[Case("load", k, export=True, dcp=k in ("llama-tied", "mixtral")) for k in KINDS],
        Case("load", "llama", checkpoint="llama-sharded", export=True, max_shard_size="20KB"),
        Case("load", "llama", export=True, export_dtype="bfloat16"),
        Case("load", "mixtral", export=True, max_shard_size="30KB"),
        Case("load", "llama-fused", export=True),  # a layout conversion that is not dim-0 safe
        Case("load", "llama", checkpoint="llama-bf16"),  # bf16 file into fp32 parameters
        Case("load", "llama-tied", strategy="NO_SHARD"),
        Case("materialize", "llama-tied", strategy="NO_SHARD"),
        *[Case("materialize", k) for k in KINDS],
        Case("errors", "llama"),
        Case("edit", "llama"),
        Case("plain", "tinygpt-tied"),
    ],
    # World size 3 shards every tensor unevenly: hidden 40 -> 14/14/12, 4 experts -> 2/2/0.
    3: [
        *LOADS,
        Case("load", "mixtral", export=True),
        Case("load", "llama-fused", export=True),
        *[Case("materialize", k) for k in ("llama", "gpt2", "gemma2", "mixtral")],
        Case("plain", "tinygpt-tied"),
    ],
    4: [
        Case("load", "llama", shard=2, replicate=2, export=True),
        Case("load", "qwen3_moe", shard=2, replicate=2, export=True),
        Case("materialize", "llama-tied", shard=2, replicate=2),
        Case("materialize", "gemma2", shard=2, replicate=2),
    ],
}


@pytest.fixture(scope="session")
def refs(tmp_path_factory):
    """Saved reference checkpoints, plus broken variants for the error cases."""
    root = tmp_path_factory.mktemp("refs")
    save_references(root)
    good = root / "llama"
    weights = load_file(good / "model.safetensors")
    for name, change in (
        ("llama-missing-key", lambda w: w.pop("model.norm.weight")),
        ("llama-extra-key", lambda w: w.__setitem__("model.layers.0.extra.weight", torch.zeros(3))),
    ):
        (root / name).mkdir()
        changed = dict(weights)
        change(changed)
        save_file(changed, root / name / "model.safetensors", metadata={"format": "pt"})
    data = (good / "model.safetensors").read_bytes()
    for name, damaged in (("llama-truncated", data[:-100]), ("llama-padded", data + bytes(100))):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(damaged)
    wide = hf_config("llama")
    wide.intermediate_size = 64
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(wide).save_pretrained(root / "llama-wide")
    (root / "empty").mkdir()
    return root


_results: dict[int, list[list[dict]]] = {}


def _world(world: int, refs, tmp_path_factory) -> list[list[dict]]:
    if world not in _results:
        out = tmp_path_factory.mktemp(f"out{world}")
        start = time.perf_counter()
        _results[world] = run_world(run_cases, world, CASES[world], str(refs), str(out), timeout=280)
        spent = ", ".join(f"{r['label']} {r['seconds']:.1f}s" for r in _results[world][0])
        print(f"\nworld {world}: {time.perf_counter() - start:.1f}s in all; {spent}")
    return _results[world]


def _params(op: str):
    return [
        # HSDP (world 4) adds a mesh shape, not a code path of load_pretrained: make test-all.
        pytest.param(w, i, id=f"w{w}-{c.kind}-{i}", marks=[pytest.mark.slow] if w == 4 else [])
        for w, cases in CASES.items()
        for i, c in enumerate(cases)
        if c.op == op
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,index", _params("load"))
def test_load_pretrained_matches_unsharded(world, index, refs, tmp_path_factory):
    ranks = _world(world, refs, tmp_path_factory)
    res = ranks[0][index]
    assert res["missing"] == [] and res["unexpected"] == [], res
    # fp32 everywhere, same kernels and thread count: weights and logits agree bit for bit.
    assert res["params_equal"], res["label"]
    assert res["logits_equal"], f"{res['label']}: logits differ by {res['logits_worst']:.2e}"
    assert res["buffers_equal"], res["label"]
    for r in ranks:  # every rank read exactly its own shards (same dtype on disk and in the model)
        got, shard = r[index]["bytes_read"], r[index]["shard_bytes"]
        if CASES[world][index].kind == "llama-fused":  # split on load: whole fused tensors are read
            assert shard < got <= shard + FUSED_BYTES, r[index]["label"]
        elif CASES[world][index].checkpoint == "llama-bf16":
            assert got * 2 == shard, r[index]["label"]
        else:
            assert got == shard, r[index]["label"]
    if "export_logits_equal" in res:
        assert res["export_logits_equal"], f"{res['label']}: exported model's logits differ"
        assert res["export_keys_equal"], f"{res['label']}: exported keys differ from save_pretrained's"
        want = "BF16" if CASES[world][index].export_dtype == "bfloat16" else "F32"
        assert res["export_dtypes"] == [want]
        sharded = CASES[world][index].max_shard_size != "5GB"
        assert ("model.safetensors.index.json" in res["export_files"]) == sharded, res["export_files"]
        assert "config.json" in res["export_files"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,index", _params("materialize"))
def test_materialize(world, index, refs, tmp_path_factory):
    res = _world(world, refs, tmp_path_factory)[0][index]
    assert res["differ_from_unsharded"] == [], res["label"]
    assert all(res["buffers"].values()), res["buffers"]
    assert res["stats_problems"] == [], res["stats_problems"]
    assert res["tied_ok"], res["ties"]
    assert res["finite_logits"]
    assert all(r[index]["rng_kept"] for r in _world(world, refs, tmp_path_factory)), "a rank's RNG state changed"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,index", _params("plain"))
def test_plain_model_with_init_fn(world, index, refs, tmp_path_factory):
    res = _world(world, refs, tmp_path_factory)[0][index]
    assert res["differ_from_unsharded"] == [], res["label"]
    assert res["tied_ok"]
    assert res["export_equal"], "export of a plain model: each tensor once, equal to the unsharded init"


@pytest.mark.timeout(300)
def test_loaded_model_does_not_see_its_file_edited(refs, tmp_path_factory):
    """load_pretrained copies: rewriting the file in place (same inode) or truncating it changes nothing."""
    ranks = _world(2, refs, tmp_path_factory)
    index = next(i for i, c in enumerate(CASES[2]) if c.op == "edit")
    for r in ranks:
        res = r[index]
        assert res["same_inode"], "the overwrite must keep the inode, as cp onto an existing file does"
        assert res["after_overwrite"] and res["after_truncate"], res
        assert res["step_equal"], "a training step after the edits differs from one on the untouched checkpoint"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama-tied", "mixtral"])
def test_dcp_to_hf(kind, refs, tmp_path_factory):
    """A DCP checkpoint written at 2 ranks -> HF files in this process, with no process group."""
    import torch.distributed as dist

    import fsdp2kit as fk

    ranks = _world(2, refs, tmp_path_factory)
    res = next(r for r in ranks[0] if r["label"].startswith(f"load, {kind},") and "dcp_dir" in r)
    assert not dist.is_initialized()
    out = tmp_path_factory.mktemp("dcp") / kind
    fk.dcp_to_hf(res["dcp_dir"], out)  # the Checkpointer root: the newest step is found
    back = pretrained(out).eval()
    ref = pretrained(refs / kind).eval()
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, ref(tokens()).logits)
    assert sorted(load_file(out / "model.safetensors")) == sorted(load_file(refs / kind / "model.safetensors"))

    bf16 = fk.dcp_to_hf(res["dcp_dir"] + "/step_00000001", out.with_name(kind + "-bf16"), dtype=torch.bfloat16)
    back = pretrained(bf16).eval()
    ref = pretrained(refs / kind, dtype=torch.bfloat16).eval()
    assert back.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, ref(tokens()).logits)


@pytest.mark.timeout(300)
def test_bad_inputs(refs, tmp_path_factory):
    ranks = _world(2, refs, tmp_path_factory)
    index = next(i for i, c in enumerate(CASES[2]) if c.op == "errors")
    res = ranks[0][index]
    for r in ranks[1:]:  # the same error everywhere: no rank carries on alone into a hang
        assert {k: v for k, v in r[index].items() if k != "seconds"} == {k: v for k, v in res.items() if k != "seconds"}
    kind, msg = res["missing_dir"]
    assert kind == "FileNotFoundError" and "does-not-exist" in msg
    kind, msg = res["empty_dir"]
    assert kind == "FileNotFoundError" and "model.safetensors" in msg
    kind, msg = res["missing_key"]
    assert kind == "ValueError" and "missing from the checkpoint: model.norm.weight" in msg
    kind, msg = res["extra_key"]
    assert kind == "ValueError" and "model.layers.0.extra.weight" in msg
    kind, msg = res["shape"]
    assert kind == "ValueError" and "model.layers.0.mlp.gate_proj.weight" in msg and "(64, 40)" in msg
    kind, msg = res["wrong_model"]
    assert kind == "ValueError" and "transformer.h.0.attn.c_attn.weight" in msg and "another model" in msg
    for damage in ("truncated", "padded"):
        kind, msg = res[damage]
        assert kind == "ValueError" and f"llama-{damage}/model.safetensors" in msg and damage in msg, msg
        assert res[f"{damage}_still_meta"]
    assert res["lenient_missing"] == ["model.norm.weight"]
    assert res["lenient_finite"]
    assert res["lenient_unexpected"] == ["model.layers.0.extra.weight"]


@pytest.mark.timeout(60)
def test_reference_checkpoints_are_what_transformers_writes(refs):
    """The MoE reference really is stored one tensor per expert (else the conversion goes untested)."""
    keys = load_file(refs / "mixtral" / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(hf_model("mixtral", meta=True).named_parameters())
