"""fsdp2kit.plan_memory and `fsdp2kit plan --batch/--seq`: the API, the CLI (table and --json), the search.

The prediction itself is checked against measured steps in tests/dist/test_memory_measured.py;
here everything runs on the meta device in a second or two.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fsdp2kit as fk
from fsdp2kit.cli import main
from fsdp2kit.cli.plan import parse_bytes
from fsdp2kit.planner.api import Settings, plan_settings
from fsdp2kit.planner.search import cheapest_changes
from fsdp2kit.planner.timeline import replay
from fsdp2kit.planner.trace import record_step


def meta_llama(layers: int = 3, vocab: int = 512, tied: bool = False) -> torch.nn.Module:
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@pytest.mark.timeout(120)
def test_plan_parts_add_up_and_knobs_move_the_peak():
    model = meta_llama()
    base = fk.plan_memory(model, shard=2, batch=2, seq=64, device="cpu")
    assert isinstance(base, fk.MemoryPlan)
    assert sum(base.parts.values()) == base.peak_bytes and base.parts["margin"] == 0
    assert base.phase.startswith(("forward", "backward", "optimizer"))
    assert base.saved_activations > 0 and base.logits_and_loss > 0
    # fp32 logits -> log_softmax output (4 bytes) at least: batch * seq * vocab * 4.
    assert base.logits_and_loss >= 2 * 64 * 512 * 4
    full = fk.plan_memory(model, shard=2, batch=2, seq=64, activation_checkpointing="full", device="cpu")
    sel = fk.plan_memory(model, shard=2, batch=2, seq=64, activation_checkpointing="selective", device="cpu")
    assert full.saved_activations < sel.saved_activations < base.saved_activations
    op = fk.plan_memory(model, shard=2, batch=2, seq=64, activation_checkpointing="op", device="cpu")
    assert full.saved_activations < op.saved_activations < sel.saved_activations  # half the matmuls kept
    # The variants below share base's recording (same batch, seq, AC and dtype) through one cache.
    cache: dict = {}

    def variant(**kw):
        return plan_settings(model, Settings(**(dict(shard=2, batch=2, seq=64, device="cpu") | kw)), cache)

    assert variant().peak_bytes == base.peak_bytes
    wider = variant(shard=4)
    assert wider.parts["params"] < base.parts["params"] and wider.parts["optimizer"] < base.parts["optimizer"]
    assert variant(optimizer="sgd").parts["optimizer"] == 0
    assert 0 < variant(optimizer="adamw8bit").parts["optimizer"] < base.parts["optimizer"]
    cuda = variant(device="cuda")
    cuda.gpu_memory = 1 << 30
    assert cuda.parts["margin"] > 0 and cuda.fits and "fits: yes" in str(cuda)
    offload = variant(cpu_offload=True)
    assert offload.parts["params"] == 0 and offload.host_bytes > 0
    # optimizer-state offload: parameters and gradients stay, the state and its step go to the host
    state = variant(optimizer_offload=True)
    assert state.parts["optimizer"] == 0 and state.parts["params"] == base.parts["params"]
    assert state.host_bytes == base.optimizer_bytes + base.param_bytes + base.grad_bytes
    assert state.peak_bytes < base.peak_bytes and state.optimizer_peak < base.optimizer_peak
    with pytest.raises(ValueError, match="cpu_offload already keeps"):
        variant(optimizer_offload=True, cpu_offload=True)
    assert variant(lora=4).parts["optimizer"] < base.parts["optimizer"]
    # The model is untouched: still on meta, no hooks left behind.
    assert all(p.is_meta for p in model.parameters()) and not model._forward_hooks


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(shard=0), "shard=0"),
        (dict(optimizer="lion"), "optimizer='lion'"),
        (dict(activation_checkpointing="most"), "mode='most'"),
        (dict(mixed_precision="fp8"), "mixed_precision='fp8'"),
        (dict(qlora=True), "qlora=True needs a LoRA rank"),
        (dict(lora=4, tp=2), "lora=4 with tp=2"),
        (dict(device="tpu"), "device='tpu'"),
        (dict(cp=0), "cp=0"),
        # the library's words (fsdp2kit.apply_context_parallel): meta_llama has 4 heads, 2 KV heads
        (dict(cp=4), "over cp=4 ranks splits the attention heads: 4 heads and 2 KV heads must both divide by 4"),
        (dict(cp=3, seq=12), "over cp=3 ranks splits the attention heads: 4 heads and 2 KV heads"),
        (dict(cp=2, seq=10), "context parallelism: seq=10 does not divide into 2 x cp = 4 equal chunks"),
        (dict(cp=2, cp_style="ulysses"), "cp_style='ulysses': expected one of ('all_to_all', 'ring')"),
        # the ring's refusals, in the library's words (parallel/context_parallel.py)
        (dict(cp=2, seq=64, cp_style="ring"), "style='ring' needs the sequence to divide by 64 x cp = 128 tokens"),
        (dict(cp=2, seq=128, cp_style="ring", packed=True), "style='ring' got packed rows"),
        (dict(cp=2, seq=128, cp_style="ring", device="cpu"), "style='ring' runs on CUDA only"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = dict(shard=2, batch=1, seq=8) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fk.plan_memory(meta_llama(), **args)


@pytest.mark.timeout(120)
def test_five_blocks_stand_for_many_exactly():
    """Running 5 of 7 identical blocks and repeating the 4th gives the same events' totals as running all 7."""
    model = meta_llama(layers=7)
    plan = fk.estimate_plan(model, shard=3, mixed_precision="bf16")
    names = [[""] if u.name.startswith("(root)") else u.name.split(" + ") for u in plan.units]
    blocks = [f"model.layers.{i}" for i in range(7)]
    from fsdp2kit.planner.parts import units_for

    units = units_for(model, plan)
    for ac in (None, "selective"):
        results = []
        for truncate in (True, False):
            rec = record_step(
                model,
                names,
                batch=2,
                seq=16,
                compute_dtype=torch.bfloat16,
                activation_checkpointing=ac,
                truncate=truncate,
            )
            assert len(rec.blocks) == (5 if truncate else 7)
            r = replay(rec, units, names, blocks, world=3, prefetch=1)
            results.append((r.peak, r.phase, r.saved_activations, r.grads_sharded, r.saved_by_block))
        assert results[0] == results[1], ac


def _cli(capsys, *args):
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.timeout(120)
def test_cli_plan_table_json_and_search(capsys):
    code, out, _ = _cli(capsys, "demo", "--shard", "2", "--batch", "2", "--seq", "64", "--json")
    assert code == 0
    data = json.loads(out)
    assert isinstance(data["peak_bytes"], int) and data["peak_bytes"] > 0
    assert data["peak_bytes"] == sum(data["parts"].values()) and data["fits"] is None
    api = fk.plan_memory(fk.models.build_causal_lm("demo", meta=True, max_seq_len=64), shard=2, batch=2, seq=64)
    assert api.peak_bytes == data["peak_bytes"]

    code, out, _ = _cli(
        capsys,
        "demo",
        "--shard",
        "2",
        "--batch",
        "2",
        "--seq",
        "64",
        "--ac",
        "full",
        "--mixed-precision",
        "bf16",
        "--gpu-memory",
        "1GiB",
    )
    assert code == 0 and "Memory plan: demo on shard=2" in out and "AC full" in out and "fits: yes" in out

    # Does not fit: the search lists changes that do, cheapest first, each under the budget.
    cpu = fk.plan_memory(
        fk.models.build_causal_lm("demo", meta=True, max_seq_len=64), shard=2, batch=2, seq=64, device="cpu"
    )
    budget = int(0.8 * cpu.peak_bytes)
    code, out, _ = _cli(
        capsys,
        "demo",
        "--shard",
        "2",
        "--batch",
        "2",
        "--seq",
        "64",
        "--device",
        "cpu",
        "--gpu-memory",
        f"{budget}B",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert data["fits"] is False and data["changes"]
    assert all(c["peak_bytes"] <= budget for c in data["changes"])
    costs = [c["cost_fraction"] for c in data["changes"]]
    assert costs == sorted(costs)

    code, _, err = _cli(capsys, "demo", "--shard", "2", "--batch", "2")
    assert code == 1 and "needs both --batch and --seq" in err
    code, _, err = _cli(capsys, "demo", "--shard", "2", "--batch", "2", "--seq", "8", "--optimizer", "lion")
    assert code == 1 and "optimizer='lion'" in err
    code, _, err = _cli(capsys, "demo", "--shard", "2", "--json")
    assert code == 1 and "give --batch and --seq" in err


@pytest.mark.timeout(120)
def test_search_on_a_case_that_does_not_fit():
    model = meta_llama(layers=3, vocab=2048)
    s = Settings(shard=2, batch=4, seq=64, device="cpu")
    plan = plan_settings(model, s, cache={})
    budget = int(plan.peak_bytes * 0.6)
    changes = cheapest_changes(model, s, budget)
    assert changes, "some change must fit at 60% of the peak"
    assert all(c["peak_bytes"] <= budget for c in changes)
    assert [c["cost_fraction"] for c in changes] == sorted(c["cost_fraction"] for c in changes)
    labels = [c["change"] for c in changes]
    # Each listed change, applied through the API, gives the peak the search reported.
    if "--ac full" in labels:
        full = fk.plan_memory(model, shard=2, batch=4, seq=64, activation_checkpointing="full", device="cpu")
        assert full.peak_bytes == changes[labels.index("--ac full")]["peak_bytes"]
    assert cheapest_changes(model, s, 1) == []  # nothing fits in one byte


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("96GB") == 96 * 10**9
    assert parse_bytes("24") == 24 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="expected a size"):
        parse_bytes("lots")


@pytest.mark.timeout(120)
def test_moe_plans_in_fp32_and_bf16():
    # torch's meta kernel for grouped_mm takes bf16 only; the recording uses transformers'
    # fallback experts op for other dtypes (tests/dist/test_memory_measured.py measures one).
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    fp32 = fk.plan_memory(model, shard=2, batch=2, seq=32, device="cpu")
    bf16 = fk.plan_memory(model, shard=2, batch=2, seq=32, mixed_precision="bf16", device="cpu")
    # The same step; bf16 halves the gathered parameters and the floating activations (the
    # batch, the routing's expert indices and token orders stay int64).
    assert fp32.measured_like["max_gathered"] == 2 * bf16.measured_like["max_gathered"]
    assert 0.5 < bf16.saved_activations / fp32.saved_activations < 0.7


@pytest.mark.timeout(120)
def test_lora_qlora_and_tp_plans_change_the_model_they_trace():
    # Block weights of whole NF4 groups (64 x 256 values) per rank at shard 2.
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    full = fk.plan_memory(model, shard=2, batch=2, seq=32, mixed_precision="bf16", device="cpu")
    lora = fk.plan_memory(model, shard=2, batch=2, seq=32, mixed_precision="bf16", lora=8, device="cpu")
    qlora = fk.plan_memory(model, shard=2, batch=2, seq=32, mixed_precision="bf16", lora=8, qlora=True, device="cpu")
    # Frozen base: only the adapters have gradients and optimizer state; NF4 blocks shrink the base.
    assert lora.measured_like["grads"] < full.measured_like["grads"] / 10
    assert qlora.parts["params"] < lora.parts["params"]
    assert qlora.measured_like["max_gathered"] < lora.measured_like["max_gathered"]
    tp = fk.plan_memory(model, shard=1, tp=2, batch=2, seq=32, device="cpu")
    dp = fk.plan_memory(model, shard=1, batch=2, seq=32, device="cpu")
    # The blocks' and embeddings' weights split in two (norms stay whole); the logits stay whole.
    assert 0.49 < tp.parts["params"] / dp.parts["params"] < 0.52
    assert tp.logits_and_loss == dp.logits_and_loss


@pytest.mark.timeout(120)
def test_context_parallel_splits_the_sequence_not_the_attention():
    """cp=C traces seq/C tokens a rank; parameters and their state are sharded over shard x cp ranks."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    seq, batch = 512, 2
    plans = {cp: fk.plan_memory(model, shard=2, cp=cp, batch=batch, seq=seq, device="cpu") for cp in (1, 2, 4)}
    for cp in (2, 4):
        p = plans[cp]
        # The sharded state is that of a shard x cp group; the logits are seq/cp tokens'.
        alone = fk.plan_memory(model, shard=2 * cp, batch=batch, seq=seq // cp, device="cpu")
        assert (p.param_bytes, p.grad_bytes, p.optimizer_bytes) == (
            alone.param_bytes,
            alone.grad_bytes,
            alone.optimizer_bytes,
        )
        # (up to an int64 tensor of positions: the model is given this rank's, not making its own)
        assert abs(p.logits_and_loss - alone.logits_and_loss) <= batch * seq * 8
        assert abs(plans[1].logits_and_loss / p.logits_and_loss - cp) < 0.01 * cp
        # Saved activations are the seq/cp step's plus, in each block, the attention output twice:
        # head-sharded over the whole sequence (what flash attention keeps for backward) and back in
        # this rank's tokens (o_proj's input), which without cp share one storage; and a little more:
        # the loop holds the whole sequences' ids, and the model, given this rank's positions, makes
        # RoPE tables per sequence (both int64/fp32 tensors of a few tokens' size).
        output = batch * (seq // cp) * config.hidden_size * 4  # fp32
        extra = p.saved_activations - alone.saved_activations - config.num_hidden_layers * output
        assert batch * seq * 8 <= extra < 0.01 * p.saved_activations
        assert 0.9 * cp < plans[1].saved_activations / p.saved_activations < cp
        assert p.peak_bytes < plans[1].peak_bytes / (0.9 * cp)
        assert "shard=2 x cp=" in str(p) and f"context parallelism cp={cp}" in str(p)
    # Full checkpointing keeps only the blocks' inputs: the seq/cp step's (and the ids, positions, RoPE tables).
    full = fk.plan_memory(model, shard=2, cp=2, batch=batch, seq=seq, activation_checkpointing="full", device="cpu")
    alone = fk.plan_memory(model, shard=4, batch=batch, seq=seq // 2, activation_checkpointing="full", device="cpu")
    assert batch * seq * 8 <= full.saved_activations - alone.saved_activations < 0.1 * alone.saved_activations
    # The all-to-all buffers are temporaries the seq/cp step does not have.
    assert full.peak_bytes > alone.peak_bytes


@pytest.mark.timeout(120)
def test_search_splits_a_long_sequence_and_cli_takes_cp(capsys):
    model = meta_llama(layers=3, vocab=2048)
    long = Settings(shard=4, batch=1, seq=2048, device="cpu")
    plan = plan_settings(model, long, cache={})
    assert plan.saved_activations + plan.logits_and_loss > plan.param_bytes + plan.grad_bytes + plan.optimizer_bytes
    budget = int(plan.peak_bytes * 0.7)
    changes = cheapest_changes(model, long, budget)
    labels = [c["change"] for c in changes]
    label = "--cp 2 --shard 2 with 2x gradient accumulation"
    assert label in labels, labels
    assert changes[labels.index(label)]["recipe"] == "--parallel.shard 2 --train.grad_accum 2 --parallel.cp 2"
    # The same GPUs (shard x cp = 4), and the peak the API gives for that change (2 micro-batches: grads held).
    cp2 = fk.plan_memory(model, shard=2, cp=2, batch=1, seq=2048, device="cpu", grad_accum=2)
    assert cp2.peak_bytes == changes[labels.index(label)]["peak_bytes"] <= budget
    # cp 4 would split 2 KV heads: the library refuses it, so the search does not offer it.
    assert not any(label.startswith("--cp 4 ") for label in labels)
    # A short sequence (the state outweighs the activations): splitting it is not offered.
    short = Settings(shard=4, batch=1, seq=8, device="cpu")
    short_plan = plan_settings(model, short, cache={})
    changes = cheapest_changes(model, short, int(short_plan.peak_bytes * 0.9))
    assert changes and not any(c["change"].startswith("--cp ") for c in changes)

    code, out, _ = _cli(capsys, "demo", "--shard", "2", "--cp", "2", "--batch", "1", "--seq", "64", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["config"]["cp"] == 2 and data["config"]["shard"] == 2
    api = fk.plan_memory(fk.models.build_causal_lm("demo", meta=True, max_seq_len=64), shard=2, cp=2, batch=1, seq=64)
    assert data["peak_bytes"] == api.peak_bytes
    code, _, err = _cli(capsys, "demo", "--shard", "2", "--cp", "3", "--batch", "1", "--seq", "66")
    assert code == 1 and "over cp=3 ranks splits the attention heads: 4 heads and 4 KV heads" in err


@pytest.mark.timeout(60)
def test_ring_trace_allocates_as_torchs_ring():
    """The ring style's trace (planner/trace.py, after torch's _templated_ring_attention on its default all-gather
    rotation): every cp rank's k and v block is held at once, in forward and again in backward, so each rank more
    adds one block to both peaks; backward keeps q, k, v, the output and the fp32 log-sum-exp."""
    from fsdp2kit.planner.live import LiveBytes
    from fsdp2kit.planner.trace import _RingAttention

    def step(cp: int) -> tuple[int, int, int]:
        with LiveBytes(incremental=True) as live:
            q, k, v = (torch.empty(1, 4, 64, 16, device="meta", dtype=torch.bfloat16).requires_grad_() for _ in "qkv")
            out = _RingAttention.apply(q, k, v, cp)
            forward, saved = live.peak, live.live
            out.backward(torch.empty_like(out))
            return forward, saved, live.peak

    block = 2 * 4 * 64 * 16 * 2  # k and v of one rank, bf16
    runs = {cp: step(cp) for cp in (2, 3, 4, 8)}
    for cp, (forward, saved, backward) in runs.items():
        assert forward - runs[2][0] == backward - runs[2][2] == (cp - 2) * block
        assert saved == 4 * block // 2 + 4 * 64 * 4  # q, k, v, out; the log-sum-exp (64 tokens: no padding)
