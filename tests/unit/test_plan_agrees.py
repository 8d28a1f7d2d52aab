"""The memory plan counts the model the run trains: its parameters, gradients and optimizer state per rank
are the ShardPlan's (issue 27: the recipe planned LoRA on every Linear while it trained q/k/v/o), and a
sequence past the model's positions is said, by the API and by the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from models import tiny_llama

import fsdp2kit as fk
from fsdp2kit.cli import main
from support.lora import apply_lora_table

QKVO = "q_proj,k_proj,v_proj,o_proj"
# (LoRA rank, targets, QLoRA, mixed precision); rank None: full fine-tuning.
CASES = {
    "lora q/k/v/o": (8, QKVO, False, "bf16"),
    "lora q/k/v/o fp32": (8, QKVO, False, None),
    "qlora all-linear": (8, "all-linear", True, "bf16"),
    "full fine-tune": (None, None, False, "bf16"),
}


def base_model() -> torch.nn.Module:
    with torch.device("meta"):  # Linear weights of whole NF4 groups (64 x 256 values) per rank at shard 2
        return tiny_llama(hidden=256, intermediate=512)


def trained_model(r, targets, qlora, mp) -> torch.nn.Module:
    """The model as the recipe trains it (recipes/support/lora.py), or the base for full fine-tuning."""
    model = base_model()
    if r is None:
        return model
    dtype = torch.bfloat16 if mp == "bf16" else torch.float32
    return apply_lora_table(model, r=r, alpha=16, dropout=0.0, targets=targets, qlora=qlora, dtype=dtype)


def state(plan) -> tuple[int, int, int]:
    if isinstance(plan, fk.MemoryPlan):
        return plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes
    return plan.param_bytes_per_rank, plan.grad_bytes_per_rank, plan.adam_bytes_per_rank


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_memory_plan_counts_the_shardplans_model(case, mesh):
    r, targets, qlora, mp = CASES[case]
    step = dict(batch=2, seq=32, mixed_precision=mp, device="cpu")
    trained = trained_model(r, targets, qlora, mp)
    shard_plan = fk.estimate_plan(trained, shard=2, mixed_precision=mp)
    # The recipe's way: the model it trains, planned as it is.
    assert state(fk.plan_memory(trained, shard=2, **step)) == state(shard_plan)
    # The API's and the CLI's way: the base and the [lora] table's settings.
    lora = {} if r is None else dict(lora=r, qlora=qlora, lora_targets=targets.split(","))
    from_base = fk.plan_memory(base_model(), shard=2, **step, **lora)
    assert state(from_base) == state(shard_plan)
    assert "per rank, all step: parameters" in str(from_base)
    if not qlora:  # NF4 needs 2 ranks a shard group: the QLoRA recipe e2e compares its printed plans
        # And the ShardPlan shard_model itself returns (a world of one here), after the plan is made.
        planned = fk.plan_memory(trained, shard=1, **step)
        assert state(planned) == state(fk.shard_model(trained, mesh, mixed_precision=mp))
    if r is not None:
        # The targets matter: all-linear trains more, so planning it for a q/k/v/o run overstated it.
        every = fk.plan_memory(base_model(), shard=2, **step, lora=r, qlora=qlora)
        assert every.grad_bytes >= from_base.grad_bytes and (targets == "all-linear") == (
            every.grad_bytes == from_base.grad_bytes
        )


@pytest.mark.timeout(120)
def test_tensor_parallel_plan_counts_one_tp_ranks_slices():
    model = base_model()
    plan = fk.plan_memory(model, shard=2, tp=2, batch=2, seq=32, device="cpu")
    assert state(plan) == state(fk.estimate_plan(model, shard=2, tp=2))
    assert state(plan) != state(fk.plan_memory(model, shard=2, batch=2, seq=32, device="cpu"))


def test_planning_lora_leaves_the_random_stream_alone():
    before = torch.random.get_rng_state()
    fk.plan_memory(base_model(), shard=2, batch=1, seq=8, lora=4, device="cpu")
    assert torch.equal(before, torch.random.get_rng_state())


def test_a_peft_model_is_planned_as_it_is():
    trained = trained_model(8, QKVO, False, "bf16")
    with pytest.raises(ValueError, match="is a peft model already"):
        fk.plan_memory(trained, shard=2, batch=1, seq=8, lora=8)
    with pytest.raises(ValueError, match="does not model LoRA adapters under tensor parallelism"):
        fk.plan_memory(trained, shard=1, tp=2, batch=1, seq=8)
    with pytest.raises(ValueError, match="needs a LoRA rank"):
        fk.plan_memory(base_model(), shard=1, batch=1, seq=8, lora_targets=["q_proj"])
    with pytest.raises(ValueError, match=r"LoRA targets \['qkv'\] match no nn.Linear"):
        fk.plan_memory(base_model(), shard=1, batch=1, seq=8, lora=4, lora_targets="qkv")


@pytest.mark.timeout(120)
def test_a_sequence_past_the_models_positions_is_said(tmp_path, capsys):
    model = base_model()  # max_position_embeddings 64
    within = fk.plan_memory(model, shard=1, batch=1, seq=64, device="cpu")
    assert not any("max_position_embeddings" in n for n in within.notes)
    past = fk.plan_memory(model, shard=1, batch=1, seq=128, device="cpu")
    note = "seq 128 exceeds the model's max_position_embeddings 64"
    assert any(note in n for n in past.notes) and f"note: {note}" in str(past)

    model.config.save_pretrained(tmp_path)  # a local directory, as a user's model
    assert main(["plan", str(tmp_path), "--shard", "1", "--batch", "1", "--seq", "128", "--device", "cpu"]) == 0
    assert f"note: {note}" in capsys.readouterr().out
    args = ["plan", str(tmp_path), "--shard", "1", "--batch", "1", "--seq", "128", "--json"]
    assert main(args) == 0 and any(note in n for n in json.loads(capsys.readouterr().out)["notes"])
    # A named config keeps its published limit (demo: 512), so planning past it says so too.
    assert main(["plan", "demo", "--shard", "1", "--batch", "1", "--seq", "1024"]) == 0
    assert "seq 1024 exceeds the model's max_position_embeddings 512" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_real_qlora_model_plans_as_its_meta_twin():
    # QLoRA from a fresh init: the recipe quantizes real weights, then plans that model; its NF4
    # weights are traced as the meta placeholders a pretrained run's are (planner/trace.py meta_copy).
    torch.manual_seed(0)
    real = apply_lora_table(
        tiny_llama(hidden=256, intermediate=512), r=8, alpha=16, dropout=0.0, targets="all-linear", qlora=True,
        dtype=torch.bfloat16,
    )  # fmt: skip
    meta = trained_model(8, "all-linear", True, "bf16")
    step = dict(shard=2, batch=2, seq=32, mixed_precision="bf16", device="cpu")
    a, b = fk.plan_memory(real, **step), fk.plan_memory(meta, **step)
    assert (a.peak_bytes, a.parts, state(a)) == (b.peak_bytes, b.parts, state(b))
