"""Rank-side code for test_masters.py: fine-tuning a bf16 checkpoint keeps fp32 master weights.

The same tiny Llama is saved twice, in bf16 and (upcast, so the same values) in fp32. Every run
starts from one of them the way the recipe does (build on meta from the directory's config,
shard_model, load_pretrained) or the way a user with ``from_pretrained`` does (real bf16 weights,
then shard_model), and takes the same AdamW steps at a fine-tuning learning rate.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp2kit as fk
from fsdp2kit._internal.dtensor import gather_full
from fsdp2kit.models import build_causal_lm

VOCAB, SEQ, BATCH, STEPS, LR = 97, 16, 2, 5, 2e-5  # vocab 97: the embedding and head shard unevenly


def save_checkpoints(root: str) -> None:
    """``root/bf16`` and ``root/fp32``: one tiny Llama in both storage dtypes, equal values."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(f"{root}/bf16")
    model.float().save_pretrained(f"{root}/fp32")


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _build(root: str, ckpt: str, order: str, mixed_precision: str):
    """The model, sharded and filled: ``order`` "meta" (recipe: meta, shard, load_pretrained) or
    "real" (from_pretrained in the checkpoint's dtype, then shard)."""
    path = f"{root}/{ckpt}"
    if order == "meta":
        model = build_causal_lm(path, meta=True)
        built = {p.dtype for p in model.parameters()}
        plan = fk.shard_model(model, fk.make_mesh(), mixed_precision=mixed_precision)
        fk.load_pretrained(model, path)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path)  # transformers 5: the stored dtype
        built = {p.dtype for p in model.parameters()}
        plan = fk.shard_model(model, fk.make_mesh(), mixed_precision=mixed_precision)
    return model, plan, sorted(str(d) for d in built)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _step(model, opt, step: int, grads: set[str] | None = None) -> float:
    x = _batch(step)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    if grads is not None:  # the dtype the reduce-scatter leaves the sharded gradients in
        grads.update(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _full(model) -> dict[str, torch.Tensor]:
    return {n: gather_full(p.detach()).float() for n, p in model.named_parameters()}


def run(root: str, ckpt: str, order: str, mixed_precision: str) -> dict:
    model, plan, built = _build(root, ckpt, order, mixed_precision)
    start = _full(model)
    opt = _optimizer(model)
    grads: set[str] = set()
    losses = [_step(model, opt, s, grads) for s in range(STEPS)]
    end = _full(model)
    changed = sum(int((end[n] != start[n]).sum()) for n in end)
    total = sum(t.numel() for t in end.values())
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {
        "built": built,
        "params": sorted({str(p.dtype) for p in model.parameters()}),
        "grads": sorted(grads),
        "state": sorted({str(t.dtype) for s in opt.state.values() for k, t in s.items() if k != "step"}),
        "plan_master": plan.master_dtype,
        "plan_state": plan.state_dtype,
        "plan_bytes": plan.param_bytes_per_rank,
        "local_bytes": local,
        "losses": losses,
        "start": start,
        "end": end,
        "unchanged": 1 - changed / total,
        "model": model,
        "opt": opt,
    }


def resume(root: str, saved: dict, ckpt_dir: str) -> dict:
    """Checkpointer round trip in the recipe's order: save after training; then a fresh build (meta,
    shard, load_pretrained), the optimizer, `Checkpointer.load`; one more step on both must agree."""
    ck = fk.Checkpointer(ckpt_dir)
    ck.save(STEPS, saved["model"], optimizer=saved["opt"])
    model, _, _ = _build(root, "bf16", "meta", "bf16")
    opt = _optimizer(model)
    step = ck.load(model, optimizer=opt)
    restored = _full(model)
    same_params = all(torch.equal(restored[n], saved["end"][n]) for n in restored)
    state_dtypes = sorted({str(t.dtype) for s in opt.state.values() for k, t in s.items() if k != "step"})
    after_resumed = _step(model, opt, STEPS)
    after_original = _step(saved["model"], saved["opt"], STEPS)
    a, b = _full(model), _full(saved["model"])
    return {
        "step": step,
        "same_params": same_params,
        "params": sorted({str(p.dtype) for p in model.parameters()}),
        "state": state_dtypes,
        "next_loss": (after_resumed, after_original),
        "next_diff": max((a[n] - b[n]).abs().max().item() for n in a),
    }


def run_cases(root: str) -> dict:
    bf16 = run(root, "bf16", "meta", "bf16")
    fp32 = run(root, "fp32", "meta", "bf16")
    real = run(root, "bf16", "real", "bf16")
    pure = run(root, "bf16", "meta", "pure_bf16")
    out = {"resume": resume(root, bf16, f"{root}/ckpt")}

    def worst(a: dict, b: dict, key: str) -> float:
        return max((a[key][n] - b[key][n]).abs().max().item() for n in a[key])

    for name, r in (("bf16", bf16), ("fp32", fp32), ("real", real), ("pure", pure)):
        out[name] = {k: v for k, v in r.items() if k not in ("start", "end", "model", "opt")}
    out["start_diff_fp32"] = worst(bf16, fp32, "start")
    out["end_diff_fp32"] = worst(bf16, fp32, "end")
    out["start_diff_real"] = worst(bf16, real, "start")
    out["end_diff_real"] = worst(bf16, real, "end")
    out["end_diff_pure"] = worst(bf16, pure, "end")
    return out
