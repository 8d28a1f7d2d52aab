"""LoRA / QLoRA set-up in one process: bad inputs fail with a sentence, plans count what ranks hold.

These run in a world of one inside the pytest process (the `mesh` fixture): no peers needed.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_llama

import fsdp2kit as fk

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _nf4_llama():
    """Block weights whose sizes are whole NF4 groups (block_size 32 x scaler_block_size 8 = 256)."""
    torch.manual_seed(0)
    return tiny_llama(hidden=64, intermediate=128).to(torch.bfloat16)


def test_apply_lora_targets():
    model = tiny_llama().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"LoRA targets \['qproj'\] match no nn.Linear.*'q_proj'.*'up_proj'"):
        fk.apply_lora(model, targets=["q_proj", "qproj"])
    peft_model = fk.apply_lora(model, r=4, alpha=8, targets=TARGETS)
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * len(TARGETS) * 3 and all("lora_" in n for n in trainable)
    # peft keeps adapters in fp32 on a bf16 base; the base stays bf16 (no upcast)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in peft_model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_plan_counts_trainable_state_only():
    model = fk.apply_lora(tiny_llama().to(torch.bfloat16), r=4, targets=TARGETS)
    plan = fk.estimate_plan(model, shard=2, mixed_precision="bf16")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # every LoRA factor here splits evenly over 2 ranks (r=4 rows for A; 40, 20 or 56 rows for B)
    assert plan.grad_bytes_per_rank == 4 * trainable // 2
    assert plan.adam_bytes_per_rank == 2 * plan.grad_bytes_per_rank
    assert len(plan.units) == 5  # adapters share their block's unit: no extra collectives


def test_plan_counts_replicated_adapters_whole(mesh):
    model = fk.apply_lora(tiny_llama().to(torch.bfloat16), r=4, targets=TARGETS)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sharded = fk.estimate_plan(model, shard=2, mixed_precision="bf16")
    plan = fk.estimate_plan(model, shard=2, mixed_precision="bf16", replicate_adapters=True)
    # fp32 adapters whole on every rank, so their gradients and AdamW state too; the frozen base stays sharded
    assert plan.grad_bytes_per_rank == 4 * trainable
    assert plan.param_bytes_per_rank - sharded.param_bytes_per_rank == 4 * trainable // 2
    # left out of fully_shard: no unit all-gathers them (2 bf16 bytes each when sharded)
    gathered = sum(u.bytes_gathered for u in sharded.units) - sum(u.bytes_gathered for u in plan.units)
    assert gathered == 2 * trainable
    assert f"{trainable / 1e3:.2f}K trainable parameters replicated" in str(plan) and "replicated" not in str(sharded)
    assert "trainable parameters replicated" in str(fk.shard_model(model, mesh, replicate_adapters=True))


def test_quantize_nf4_and_plan():
    model = _nf4_llama()
    n_base = sum(p.numel() for b in model.model.layers for n, p in b.named_parameters() if n.endswith("proj.weight"))
    names = fk.quantize_nf4(model, block_size=32, scaler_block_size=8)
    assert len(names) == 7 * 3 and all(".layers." in n for n in names)
    assert model.lm_head.weight.dtype == torch.bfloat16 and type(model.lm_head.weight).__name__ == "Parameter"
    peft_model = fk.apply_lora(model, r=4, targets=TARGETS)
    plan = fk.estimate_plan(peft_model, shard=4)
    rest = sum(p.numel() * p.element_size() for p in peft_model.parameters() if type(p).__name__ != "NF4Tensor")
    # 4 bits a weight, plus an int8 scaler per 32 weights and a bf16 factor per 256, over 4 ranks
    nf4_bytes = n_base * (0.5 + 1 / 32 + 2 / 256) / 4
    small = 7 * 3 * (2 + 2 * 16)  # per weight, on every rank: the bf16 scaler mean and the 16-entry table
    assert plan.param_bytes_per_rank == pytest.approx(nf4_bytes + small + rest / 4, rel=0.02)
    # FSDP2 all-gathers the packed 4-bit weights (each Linear dequantizes its own in its forward):
    # a block's gathered bytes are its NF4 storage plus its norms and adapters as held, not bf16 weights.
    block = peft_model.base_model.model.model.layers[0]
    block_rest = sum(p.numel() * p.element_size() for p in block.parameters() if type(p).__name__ != "NF4Tensor")
    block_nf4 = sum(p.numel() for n, p in block.named_parameters() if type(p).__name__ == "NF4Tensor")
    gathered = plan.units[0].bytes_gathered
    assert gathered == pytest.approx(block_nf4 * (0.5 + 1 / 32 + 2 / 256) + block_rest, rel=0.02), plan
    with pytest.raises(ValueError, match=r"NF4 weights cannot be sharded 3 ways.*64 rows do not split evenly"):
        fk.estimate_plan(peft_model, shard=3)
    with pytest.raises(ValueError, match=r"need a shard group of 2 or more ranks"):
        fk.estimate_plan(peft_model, shard=2, strategy="NO_SHARD")


def test_quantize_nf4_refusals(mesh):
    with pytest.raises(ValueError, match=r"nothing to quantize in LlamaForCausalLM.*multiple of block_size"):
        fk.quantize_nf4(tiny_llama())  # 40 x 40 weights: no whole 64 x 256 groups
    with torch.device("meta"):
        meta = tiny_llama(hidden=64, intermediate=128)
    # On the meta device: NF4 placeholders for load_pretrained to fill (tests/dist/test_qlora_load.py);
    # they have no init of their own, so materialize refuses them.
    assert len(fk.quantize_nf4(meta, block_size=32, scaler_block_size=8)) == 7 * 3
    assert all(p.is_meta for p in meta.parameters())
    with pytest.raises(ValueError, match=r"materialize cannot initialise NF4 weights.*load_pretrained"):
        fk.materialize(meta)
    peft_model = fk.apply_lora(_nf4_llama(), targets=TARGETS)
    with pytest.raises(ValueError, match=r"before PEFT wrapping"):
        fk.quantize_nf4(peft_model, block_size=32, scaler_block_size=8)
    model = _nf4_llama()
    fk.shard_model(model, mesh)
    with pytest.raises(ValueError, match=r"must run before shard_model"):
        fk.quantize_nf4(model, block_size=32, scaler_block_size=8)


def test_optimizer_with_frozen_parameters(mesh):
    model = fk.apply_lora(tiny_llama(), r=4, targets=TARGETS)
    fk.shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters())  # the frozen base too
    model(torch.zeros(1, 4, dtype=torch.long))  # the first forward finds it: no process-wide optimizer hook
    with pytest.raises(RuntimeError, match=r"holds the frozen parameter 'base_model.model.model.embed_tokens.weight'"):
        opt.step()
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]).step()  # the right way


def test_replicate_adapters_refusals(mesh):
    with pytest.raises(ValueError, match=r"has 0 trainable of .*expected a LoRA / QLoRA model"):
        fk.shard_model(tiny_llama().requires_grad_(False), mesh, replicate_adapters=True)
    with pytest.raises(ValueError, match=r"has (\d+) trainable of \1 parameters"):
        fk.shard_model(tiny_llama(), mesh, replicate_adapters=True)
    with pytest.raises(ValueError, match=r"cpu_offload=True: replicated adapters stay on the device"):
        fk.shard_model(
            fk.apply_lora(tiny_llama(), r=4, targets=TARGETS), mesh, replicate_adapters=True, cpu_offload=True
        )
    model = fk.apply_lora(tiny_llama(), r=4, targets=TARGETS)
    fk.shard_model(model, mesh, replicate_adapters=True)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters() if p.requires_grad)
