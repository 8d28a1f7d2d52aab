"""Memory per rank and speed at context parallelism 1 / 2 / 4 for the same global sequence, on CPU (gloo).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/cp_memory.py [--seq 4096] [--out benchmarks/results/cp_memory]

Each cp degree is its own world of cp ranks (cp 1: one process on the whole sequence), FSDP over
the cp ranks (make_mesh(shard=1, cp=C): parameters, gradients and AdamW state shard over them
too). Peak memory is the live tensor bytes of one training step (fsdp2kit.planner.live.LiveBytes,
the recipe's CPU figure: parameters, gradients, optimizer state and every tensor alive at each op),
measured on the second step, once the optimizer state exists, beside `fsdp2kit.plan_memory(...,
cp=C, device="cpu")`'s prediction for the same step (the model built on the meta device). Tokens/s is the global sequence over
the median wall time of the later, unwatched steps: on a shared 2-core CPU with C ranks on 2 cores
it says little about GPUs, and is reported as measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2kit as fk
from fsdp2kit.testing import run_world


def build(vocab: int, hidden: int, layers: int, meta: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 17,
                      attn_implementation="sdpa")  # fmt: skip
    with torch.device("meta" if meta else "cpu"):
        return LlamaForCausalLM(cfg)


def rank_main(cp: int, seq: int, vocab: int, hidden: int, layers: int, steps: int) -> dict:
    from fsdp2kit.planner.live import LiveBytes

    mesh = fk.make_mesh(shard=1, cp=cp)
    model = build(vocab, hidden, layers)
    if cp > 1:
        fk.apply_context_parallel(model, mesh)
    fk.shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, seq + 1), generator=gen)
    whole = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq)[None]}
    batch = fk.split_for_context_parallel(whole, mesh)
    count = float(seq)

    def loss_sum():  # the logits die with it, before backward, as in the recipe's step (and the planner's)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")

    def step():
        (loss_sum() * dist.get_world_size() / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    live = LiveBytes()
    live.track([*model.parameters(), *model.buffers()])
    live.track(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    with live:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    params = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"peak_live_bytes": live.peak, "param_bytes": params, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--out", default="benchmarks/results/cp_memory")
    a = ap.parse_args()
    rows = []
    for cp in [int(c) for c in a.cp.split(",")]:
        ranks = run_world(rank_main, cp, cp, a.seq, a.vocab, a.hidden, a.layers, a.steps, timeout=1800)
        step_s = max(r["step_s"] for r in ranks)
        plan = fk.plan_memory(build(a.vocab, a.hidden, a.layers, meta=True), shard=1, cp=cp, batch=1, seq=a.seq,
                              prefetch=0, device="cpu")  # fmt: skip
        rows.append({"cp": cp, "peak_live_bytes_per_rank": max(r["peak_live_bytes"] for r in ranks),
                     "predicted_bytes_per_rank": plan.peak_bytes,
                     "param_bytes_per_rank": max(r["param_bytes"] for r in ranks), "step_s": step_s,
                     "tokens_per_s": a.seq / step_s})  # fmt: skip
        print(rows[-1], flush=True)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s) per rank"
    result = {"config": vars(a), "machine": machine, "rows": rows}
    Path(a.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    base = rows[0]["peak_live_bytes_per_rank"]
    lines = [
        f"# Memory per rank at cp 1/2/4, one sequence of {a.seq} tokens (Llama {a.layers} layers, hidden {a.hidden}, "
        f"8 heads / 4 KV heads, vocab {a.vocab}, fp32, AdamW, sdpa, no activation checkpointing)",
        "",
        "Measured by `benchmarks/cp_memory.py` on CPU/gloo: peak live tensor bytes of one training step per rank "
        "(parameters, gradients and optimizer state shard over the cp ranks too). Tokens/s: C ranks sharing this "
        "machine's cores, so it measures the overhead here, not a GPU's scaling.",
        "",
        f"Machine: {machine}.",
        "",
        "| cp | peak live MiB per rank | predicted MiB | predicted vs measured | vs cp 1 | sharded params MiB per rank "
        "| step s | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak, pred = r["peak_live_bytes_per_rank"], r["predicted_bytes_per_rank"]
        lines.append(
            f"| {r['cp']} | {peak / 2**20:.1f} | {pred / 2**20:.1f} | {(pred - peak) / peak:+.2%} | {peak / base:.2f} | "
            f"{r['param_bytes_per_rank'] / 2**20:.2f} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} |"
        )
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
