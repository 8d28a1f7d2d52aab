"""Rank-side code for test_finetune_loss.py: the answer-token loss and the held-out eval on a real gloo group."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fsdp2kit as fk
from support.evaluate import evaluate
from support.formats import IGNORE
from support.loader import to_batch
from support.loss import answer_loss_sum, backward_global_mean
from support.rows import pack_examples

SEQ = 16
ACCUM = 2


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    return AutoModelForCausalLM.from_config(cfg)


def micro_batch(rank: int, micro: int) -> dict[str, torch.Tensor]:
    """Four examples packed in rows; the answer share falls with the rank, so ranks hold very different token counts
    (rank 0 trains on most tokens, the last rank on one or two per example)."""
    g = torch.Generator().manual_seed(100 * rank + micro)
    ids = [torch.randint(3, 64, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (4,), generator=g)]
    keep = [max(1, len(x) // (1 + 3 * rank)) for x in ids]  # answer tokens at the end of each example
    labels = [[IGNORE] * (len(x) - k) + x[len(x) - k :] for x, k in zip(ids, keep)]
    rows = pack_examples({"ids": ids, "labels": labels}, seq_len=SEQ, pad_id=0, packing=True)
    return to_batch(rows)


def eval_rows():
    import datasets

    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 64, (int(n),), generator=g).tolist() for n in torch.randint(3, 15, (12,), generator=g)]
    return datasets.Dataset.from_dict(pack_examples({"ids": ids, "labels": ids}, seq_len=SEQ, pad_id=0, packing=True))


def run_cases() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama()
    reference = copy.deepcopy(model)
    fk.shard_model(model, fk.make_mesh())

    # the recipe's step: global count first, then the scaled micro-steps with no_sync
    mine = [micro_batch(rank, m) for m in range(ACCUM)]
    local_sum, count = backward_global_mean(model, mine, dp_size=world, device="cpu")
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    logged = local_sum.clone()
    dist.all_reduce(logged)

    # one process, every rank's micro-batches together: sum of token losses / number of answer tokens
    everyone = [micro_batch(r, m) for r in range(world) for m in range(ACCUM)]
    total = sum(answer_loss_sum(reference, b) for b in everyone)
    n = sum(int((b["labels"] != IGNORE).sum()) for b in everyone)
    (total / n).backward()
    worst = max(((grads[k] - p.grad).abs().max() / p.grad.abs().max()).item() for k, p in reference.named_parameters())
    # what a mean of per-rank means would have given: the test must tell it apart
    naive = copy.deepcopy(reference)
    naive.zero_grad()
    per_rank = [
        sum(answer_loss_sum(naive, micro_batch(r, m)) for m in range(ACCUM))
        / sum(int((micro_batch(r, m)["labels"] != IGNORE).sum()) for m in range(ACCUM))
        for r in range(world)
    ]
    (sum(per_rank) / world).backward()
    naive_grads = dict(naive.named_parameters())
    naive_worst = max(
        ((naive_grads[k].grad - p.grad).abs().max() / p.grad.abs().max()).item()
        for k, p in reference.named_parameters()
    )
    rows = eval_rows()
    sharded = evaluate(model, rows, 2, rank=rank, world_size=world, device="cpu")
    single = evaluate(reference, rows, 2, rank=0, world_size=1, device="cpu")
    return {
        "worst_grad_rel": worst,
        "count": int(count.item()),
        "n": n,
        "logged_mean": (logged / count).item(),
        "reference_mean": (total / n).item(),
        "naive_grad_rel": naive_worst,
        "eval_sharded": sharded,
        "eval_single": single,
    }
