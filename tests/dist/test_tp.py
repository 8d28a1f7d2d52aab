"""Tensor parallelism composed with FSDP: parity with one process, and every piece of fsdp2kit on a TP model.

Two spawns in `make test` (4 ranks: FSDP 2 x TP 2 and HSDP 2 x FSDP 1 x TP 2; 2 ranks: TP 2 alone),
each running many cases; `make test-all` adds the checkpoint's load in one process. HSDP 2 x FSDP 2 x TP 2
needs 8 ranks: on this 2-core machine that is a slow test (make test-all); `make test` trains the 3-D mesh
with a shard dim of 1.

Per-block compile on a TP model: `make test` compiles with backend="aot_eager" (dynamo and
AOTAutograd, where the bug `compile_blocks` works around lives, without inductor's C++ build);
inductor itself runs in a slow test.
"""

from __future__ import annotations

import re

import pytest
import torch
from tp_cases import TPCase, build, run_ckpt_load, run_world2, run_world4

from fsdp2kit.testing import run_world

RTOL = 1e-5  # fp32, after 3 optimizer steps

WORLD4 = [
    TPCase(model="llama", optim="sgd", shard=2),
    TPCase(model="qwen3", optim="adamw", shard=2),
    TPCase(model="llama-tied", optim="adamw", shard=2, clip=0.05, loss_parallel=True),
    TPCase(model="llama", optim="adamw", shard=2, accum=2, ac="full"),
    # the 3-D mesh (replicate, shard, tp) at 4 ranks: HSDP 2 x FSDP 1 x TP 2
    TPCase(model="qwen3", optim="sgd", shard=1, replicate=2),
    # per-block compile composed with FSDP x TP, activation checkpointing and the tied head
    TPCase(model="llama-tied", optim="adamw", shard=2, ac="full", clip=0.05, compile="aot_eager"),
]
WORLD2 = [
    TPCase(model="llama", optim="adamw"),
    TPCase(model="qwen3", optim="sgd", clip=0.5),
    TPCase(model="llama-tied", optim="sgd", ac="selective"),
    # make test-all: WORLD4's compiled case proves compile_blocks on a TP model, with FSDP, AC and the tied head too
    TPCase(model="llama", optim="adamw", compile="aot_eager"),
]
SLOW2 = {len(WORLD2) - 1}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, selected):
    work = tmp_path_factory.mktemp("tp")
    build("llama").save_pretrained(work / "hf-llama")
    # only the parity cases this session's tests read: a slow one is not trained under make test
    chosen = {w: sorted(i for v, i in selected("world", "index") if v == w) for w in (4, 2)}
    w4 = run_world(run_world4, 4, [WORLD4[i] for i in chosen[4]], str(work), timeout=500)
    w2 = run_world(run_world2, 2, [WORLD2[i] for i in chosen[2]], str(work), timeout=300)
    for w, ranks in ((4, w4), (2, w2)):
        for r in ranks:
            r["parity"] = dict(zip(chosen[w], r["parity"]))
    return {"work": work, 4: w4, 2: w2}


PARITY = [pytest.param(4, i, id=f"w4-{c.label}") for i, c in enumerate(WORLD4)] + [
    pytest.param(2, i, id=f"w2-{c.label}", marks=[pytest.mark.slow] if i in SLOW2 else []) for i, c in enumerate(WORLD2)
]


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("world,index", PARITY)
def test_tp_parity(worlds, world: int, index: int, parity_table) -> None:
    ranks = [r["parity"][index] for r in worlds[world]]
    res = ranks[0]
    parity_table.append((res["label"] + " (TP)", world, res["worst_rel"], res["worst_param"]))
    for r in ranks:
        assert r["worst_rel"] < RTOL, f"{r['label']}: {r['worst_param']} differs by {r['worst_rel']:.2e}"
        # The plan's per-rank bytes are analytic from the TP slices; rank 0 holds the largest shard.
    assert res["plan_bytes"] == res["local_bytes"], res["plan_text"]
    assert "tp=2" in res["plan_text"]
    if res["counted"] is not None:  # FSDP's collectives under TP equal fsdp2kit.planner.comm's, on every rank
        for r in ranks:
            assert r["counted"] == r["predicted"], f"{r['label']}: counted != predicted"
            assert r["tp_calls"] > 0, "TP's own collectives were not seen"
    if "tied" in res["label"]:
        assert all(r["tied"] for r in ranks), "the tied head must stay one parameter under TP"
    if res["graphs"] is not None:
        # One graph serves every block and nothing breaks it. (Without compile_blocks' wait, the
        # first block, fed the embedding's AsyncCollectiveTensor, got a graph of its own.)
        assert res["graphs"] == (1, 0), f"(graphs, graph breaks) = {res['graphs']}"
    if res["norms"]:
        # clip_grad_norm_: the norm over both meshes equals the reference's, on every rank.
        for r in ranks:
            assert r["norms"] == ranks[0]["norms"]
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(res["ref_norms"]), rtol=1e-5, atol=0)


@pytest.mark.timeout(1000)
def test_tp_materialize_is_the_unsharded_init(worlds) -> None:
    for r in worlds[4]:
        comp = r["composition"]
        assert comp["materialize_llama-tied"] == [] and comp["materialize_qwen3"] == []


@pytest.mark.timeout(1000)
def test_tp_load_pretrained_reads_only_its_slice(worlds) -> None:
    for r in worlds[4]:
        comp = r["composition"]
        assert comp["load_differs"] == []
        # Each rank reads its own TP x FSDP slice: about a quarter of the model, never all of it.
        assert comp["load_bytes_read"] <= comp["load_local_bytes"] * 1.05, comp
        assert comp["load_bytes_read"] < comp["load_total_bytes"] / 2, comp


@pytest.mark.timeout(1000)
def test_tp_checkpoint_reshards(worlds) -> None:
    # Saved at TP 2 x FSDP 2; loaded at FSDP 4 and TP 2 x FSDP 1: bit-equal weights and Adam state.
    _loaded({"FSDP 4": worlds[4][0]["composition"]["ckpt_fsdp4"], "TP 2": worlds[2][0]["ckpt_tp2"]})


@pytest.mark.slow  # a spawn of its own; make test reshards this checkpoint at FSDP 4 and TP 2 (above)
@pytest.mark.timeout(1000)
def test_tp_checkpoint_loads_in_one_process(worlds) -> None:
    _loaded({"1 proc": run_world(run_ckpt_load, 1, str(worlds["work"]), 1, 1, timeout=120)[0]})


def _loaded(loads: dict) -> None:
    for label, (step, params_differ, optim_differ) in loads.items():
        assert step == 2, label
        assert params_differ == [], f"{label}: {params_differ}"
        assert optim_differ == [], f"{label}: {optim_differ}"


@pytest.mark.timeout(1000)
def test_tp_export_hf_and_dcp_to_hf(worlds) -> None:
    from transformers import AutoModelForCausalLM

    import fsdp2kit as fk

    work = worlds["work"]
    saved = torch.load(work / "saved.pt")["params"]
    fk.dcp_to_hf(work / "ckpt", work / "export-dcp", config=work / "export-live")
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for name in ("export-live", "export-dcp"):
        back = AutoModelForCausalLM.from_pretrained(work / name)
        got = dict(back.named_parameters())
        assert all(torch.equal(got[k], v) for k, v in saved.items() if k in got), name
        assert back.lm_head.weight is back.get_input_embeddings().weight
        logits.append(back(x).logits)
    assert torch.equal(logits[0], logits[1])


ERRORS = {
    "heads": r"needs these sizes to divide by 2, and they do not: config\.num_attention_heads = 3",
    "pattern": r"entries match no module of LlamaForCausalLM: \['model\.layers\.\*\.nope'\]",
    "style": r"style 'packed_colwise' is not supported",
    "tied": r"a tied weight is laid out differently.*model\.embed_tokens\.weight: not split",
    "not_linear": r"splits nn\.Linear and nn\.Embedding weights.*model\.norm \(LlamaRMSNorm\)",
    "after_ac": r"apply_tensor_parallel must be called before apply_activation_checkpointing",
    "twice": r"already applied",
    "float8_after": r"enable_float8 must be called before apply_tensor_parallel",
    "no_tp_model": r"the mesh has a tp dimension of size 2 but the model is not tensor-parallel",
    "no_tp_mesh": r"needs a mesh with a 'tp' dimension",
    "no_shard_strategy": r"NO_SHARD with tensor parallelism is not supported",
    "tp3": r"shard=1, replicate=1, tp=3 does not fit the world size 2; sizes that work: \(shard=2, replicate=1\), "
    r"\(shard=1, replicate=2\), \(shard=1, replicate=1, tp=2\)",
    "after_shard": r"must be called before shard_model",
}


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("key", list(ERRORS))
def test_tp_errors(worlds, key: str) -> None:
    for r in worlds[2]:
        got = r["errors"][key]
        assert got is not None and re.search(ERRORS[key], got), f"{key}: {got}"


@pytest.mark.timeout(1000)
def test_tp_order_and_mesh_names(worlds) -> None:
    errors = worlds[2][0]["errors"]
    assert errors["ac_after_tp"] is None  # activation checkpointing comes after TP
    assert errors["compile_after_tp"] is None  # and so does per-block compile
    assert errors["mesh_names"] == [("shard", "tp"), ("shard",)]


@pytest.mark.timeout(1000)
def test_tp_after_float8(worlds) -> None:
    # torchao's float8 TP styles on the Float8Linear layers; the same float8 model in one process
    # computes the same tensorwise scales (amax over the whole weight), so losses agree closely.
    for r in worlds[2]:
        res = r["float8"]
        assert res["float8_layers"]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(res["ref_losses"]), rtol=1e-3, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tp_hsdp_fsdp_tp_8_ranks() -> None:
    # HSDP 2 x FSDP 2 x TP 2: 8 processes, too slow for `make test` on 2 cores (make test-all runs it).
    from tp_cases import run_parity_cases

    cases = [TPCase(model="llama-tied", optim="adamw", shard=2, replicate=2, clip=0.05)]
    ranks = [r[0] for r in run_world(run_parity_cases, 8, cases, timeout=1100)]
    for r in ranks:
        assert r["worst_rel"] < RTOL, r
        assert r["tied"] and r["norms"] == ranks[0]["norms"]
    assert ranks[0]["plan_bytes"] == ranks[0]["local_bytes"]
    torch.testing.assert_close(torch.tensor(ranks[0]["norms"]), torch.tensor(ranks[0]["ref_norms"]), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tp_compiled_inductor(parity_table) -> None:
    """compile_blocks with inductor (C++ on CPU) on TP 2 and FSDP 2 x TP 2, against the eager reference.

    Slow (make test-all): inductor builds C++ for each rank (~1 min per world on 2 cores). Held
    to the same 1e-5 as eager TP: measured here at 3.8e-6 (TP 2 Llama) and 5.3e-7 (FSDP 2 x TP 2
    Qwen3, with clipping) after 3 AdamW steps; the eager TP cases of these models give 3.6e-6 and
    4.7e-6 (Qwen3 without clipping) (inductor's reordered fp32 arithmetic stays well inside it at this size).
    """
    from tp_cases import run_parity_cases

    worlds = {
        2: [TPCase(model="llama", optim="adamw", compile="inductor")],
        4: [TPCase(model="qwen3", optim="adamw", shard=2, clip=0.05, compile="inductor")],
    }
    for world, cases in worlds.items():
        ranks = run_world(run_parity_cases, world, cases, timeout=700)
        for i, case in enumerate(cases):
            parity_table.append((case.label + " (TP)", world, ranks[0][i]["worst_rel"], ranks[0][i]["worst_param"]))
            for r in ranks:
                res = r[i]
                assert res["worst_rel"] < RTOL, (
                    f"{res['label']}: {res['worst_param']} differs by {res['worst_rel']:.2e}"
                )
                assert res["graphs"] == (1, 0), f"(graphs, graph breaks) = {res['graphs']}"
