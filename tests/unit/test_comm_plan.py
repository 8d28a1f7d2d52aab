"""The predicted FSDP collectives (fsdp2kit.planner.comm): counts per policy, padding, dtypes, errors.

That the predictions equal what a running model sends, byte for byte, is tests/dist/test_comm.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from models import build

from fsdp2kit.planner.comm import ACCUMULATION, plan_comm


def _padded_bytes(module: torch.nn.Module, shard: int, itemsize: int) -> int:
    return sum(math.ceil(p.shape[0] / shard) * shard * math.prod(p.shape[1:]) * itemsize for p in module.parameters())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shard", [2, 3])
def test_block_bytes_are_padded_shards(shard: int) -> None:
    model = build("tinygpt")
    plan = plan_comm(model, shard=shard)
    block = next(u for u in plan.units if u.name == "trunk.0")
    want = _padded_bytes(model.trunk[0], shard, 4)
    assert {c.nbytes for c in block.collectives} == {want}
    if shard == 3:  # 40-row weights pad to 42: the padding travels
        assert want > sum(p.numel() for p in model.trunk[0].parameters()) * 4


@pytest.mark.timeout(60)
def test_mixed_precision_dtypes() -> None:
    plan = plan_comm(build("tinygpt"), shard=2, mixed_precision="bf16")
    kinds = {(c.kind, c.dtype) for u in plan.units for c in u.collectives}
    assert kinds == {("all_gather", "bfloat16"), ("reduce_scatter", "float32")}
    block = next(u for u in plan.units if u.name == "trunk.0")
    ag = next(c for c in block.collectives if c.kind == "all_gather")
    rs = next(c for c in block.collectives if c.kind == "reduce_scatter")
    assert rs.nbytes == 2 * ag.nbytes


@pytest.mark.timeout(60)
def test_policies_counts_per_step() -> None:
    model = build("tinygpt")
    m = 4
    counts = {a: plan_comm(model, shard=2, replicate=2, micro_batches=m, accumulation=a).counts() for a in ACCUMULATION}
    one = plan_comm(model, shard=2, replicate=2).counts()
    units = len(plan_comm(model, shard=2).units)
    assert counts["regather"] == {g: {k: m * n for k, n in kinds.items()} for g, kinds in one.items()}
    assert counts["keep_gathered"]["shard"]["all_gather"] == units
    assert counts["keep_gathered"]["shard"]["reduce_scatter"] == m * units
    assert counts["defer_all_reduce"]["replicate"]["all_reduce"] == units
    assert counts["defer_all_reduce"]["shard"] == counts["regather"]["shard"]
    assert counts["no_sync"]["shard"]["reduce_scatter"] == units
    assert counts["keep_gathered_defer_all_reduce"]["replicate"]["all_reduce"] == units
    assert counts["keep_gathered_defer_all_reduce"]["shard"] == counts["keep_gathered"]["shard"]
    assert counts["keep_gathered_no_sync"] == {
        "shard": {"all_gather": units, "reduce_scatter": units},
        "replicate": {"all_reduce": units},
    }


@pytest.mark.timeout(60)
def test_no_shard_all_reduces_whole_gradients() -> None:
    model = build("tinygpt")
    plan = plan_comm(model, shard=2, strategy="NO_SHARD")
    assert plan.by_group() == {"shard": {"all_reduce": sum(p.numel() for p in model.parameters()) * 4}}


@pytest.mark.timeout(60)
def test_errors() -> None:
    model = build("tinygpt")
    with pytest.raises(ValueError, match="accumulation="):
        plan_comm(model, shard=2, accumulation="sometimes")
    with pytest.raises(ValueError, match="needs HSDP"):
        plan_comm(model, shard=2, micro_batches=2, accumulation="defer_all_reduce")
    with pytest.raises(ValueError, match="micro_batches"):
        plan_comm(model, shard=2, micro_batches=0)


@pytest.mark.timeout(60)
def test_settings_agree_with_keywords() -> None:
    from fsdp2kit.planner.api import Settings
    from fsdp2kit.planner.comm import comm_of_settings

    model = build("llama")
    s = Settings(shard=2, replicate=2, batch=1, seq=8, mixed_precision="bf16", lora=4, grad_accum=3)
    got = comm_of_settings(model, s, accumulation="no_sync")
    want = plan_comm(
        model, shard=2, replicate=2, mixed_precision="bf16", lora=4, micro_batches=3, accumulation="no_sync"
    )
    assert got.by_group() == want.by_group() and got.bytes_per_step > 0


@pytest.mark.timeout(60)
def test_held_bytes_per_policy() -> None:
    model = build("tinygpt")
    numel = sum(p.numel() for p in model.parameters())

    def held(policy: str, m: int = 4, **kw) -> int:
        return plan_comm(model, shard=2, replicate=2, micro_batches=m, accumulation=policy, **kw).held_bytes

    assert held("regather") == 0 and held("keep_gathered", m=1) == 0
    assert held("keep_gathered") == _padded_bytes(model, 2, 4)  # the whole model gathered, padding included
    assert held("keep_gathered", mixed_precision="bf16") == _padded_bytes(model, 2, 2)
    assert held("no_sync") == numel * 4
    assert held("no_sync", mixed_precision="bf16") == numel * 4  # FSDP2 accumulates in the fp32 reduce dtype
    assert held("defer_all_reduce") == _padded_bytes(model, 2, 4) // 2
    assert held("keep_gathered_no_sync") == held("keep_gathered") + held("no_sync")
    assert held("keep_gathered_defer_all_reduce") == held("keep_gathered") + held("defer_all_reduce")


@pytest.mark.timeout(60)
def test_the_planner_picks_the_fewest_bytes_that_fit(capsys) -> None:
    import json

    from fsdp2kit.cli import main
    from fsdp2kit.models import build_causal_lm
    from fsdp2kit.planner.api import Settings
    from fsdp2kit.planner.search import pick_accumulation

    model = build_causal_lm("demo", meta=True)
    s = Settings(shard=2, replicate=2, batch=2, seq=64, mixed_precision="bf16", grad_accum=4, device="cpu")
    _, _, rows = pick_accumulation(model, s, None)
    by = {r["policy"]: r for r in rows}
    assert set(by) == set(ACCUMULATION)
    # each held byte is in the peak: keeping the model gathered costs more memory than regathering it
    assert by["keep_gathered_no_sync"]["peak_bytes"] > by["keep_gathered"]["peak_bytes"] > by["regather"]["peak_bytes"]
    for budget in sorted({r["peak_bytes"] for r in rows}):
        picked, plan, rows = pick_accumulation(model, s, budget)
        fits = [r for r in rows if r["peak_bytes"] <= budget]
        assert plan.peak_bytes <= budget and by[picked.accumulation]["peak_bytes"] == plan.peak_bytes
        assert by[picked.accumulation]["comm_bytes_per_step"] == min(r["comm_bytes_per_step"] for r in fits)
    picked, plan, _ = pick_accumulation(model, s, 1)  # none fits: the lowest peak, then the fewest bytes
    assert picked.accumulation == "defer_all_reduce"
    args = ["plan", "demo", "--shard", "2", "--replicate", "2", "--batch", "2", "--seq", "64"]
    args += ["--mixed-precision", "bf16", "--grad-accum", "4", "--device", "cpu", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    # no memory budget: not the fewest bytes (every policy would "fit", so the one holding the most), the lowest peak
    lowest = min(rows, key=lambda r: (r["peak_bytes"], r["comm_bytes_per_step"]))["policy"]
    assert lowest != "keep_gathered_no_sync" and by[lowest]["peak_bytes"] < by["keep_gathered_no_sync"]["peak_bytes"]
    assert out["config"]["accumulation"] == lowest and out["accumulation_policies"] == rows
    assert main(args[:-1]) == 0
    assert f"{lowest} (no memory budget (--gpu-memory or --gpu): the lowest peak)" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_replicated_adapters_all_reduce_once_a_step() -> None:
    from fsdp2kit.planner.adapt import lora_model

    model = build("llama")
    peft = lora_model(model, r=4, qlora=False, targets="all-linear", compute_dtype=None)
    adapters = sum(p.numel() for p in peft.parameters() if p.requires_grad) * 4  # fp32
    kw = dict(shard=2, replicate=2, lora=4, micro_batches=4, accumulation="keep_gathered")
    plan, sharded = plan_comm(model, replicate_adapters=True, **kw), plan_comm(model, **kw)
    units = len(plan.units)
    # nothing reduce-scattered: one all-reduce of the whole adapters over each group, after the root's backward
    assert plan.counts() == {"shard": {"all_gather": units, "all_reduce": 1}, "replicate": {"all_reduce": 1}}
    assert plan.by_group()["replicate"]["all_reduce"] == plan.by_group()["shard"]["all_reduce"] == adapters
    assert plan.units[-1].collectives[-1].kind == "all_reduce"
    frozen_gathers = sum(c.total for u in plan.units for c in u.collectives if c.kind == "all_gather")
    assert frozen_gathers < sharded.by_group()["shard"]["all_gather"]  # the adapters are not gathered
    with pytest.raises(ValueError, match="expected a LoRA / QLoRA model"):
        plan_comm(model, shard=2, replicate_adapters=True)  # everything trainable: no frozen base
