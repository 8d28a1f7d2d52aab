"""The memory planner against measurement: predicted vs measured per-rank peak of live tensor bytes, on CPU.

For each configuration, real gloo ranks train a tiny Llama (transformers) with fsdp2kit exactly as
the recipe does (AC, shard_model, AdamW, the recipe's loss); after a warm-up step, one step runs
under `measure_step` (benchmarks/measure_step.py), which counts live tensor storage bytes at every op
(not RSS) and tells parameters, gradients, optimizer state, gathered parameters and FSDP buffers
apart. The prediction is `fsdp2kit.plan_memory(..., device="cpu")` on the same model built on the
meta device. Writes benchmarks/results/memory_planner.{json,md}.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/memory_planner_check.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# name: (world, replicate, ac, mixed precision, batch, seq, model size)
GRID: list[dict] = [
    dict(world=2, replicate=1, ac=None, mp=None, batch=2, seq=64, size="s"),
    dict(world=2, replicate=1, ac="full", mp=None, batch=4, seq=64, size="s"),
    dict(world=2, replicate=1, ac="selective", mp="bf16", batch=2, seq=128, size="s"),
    dict(world=2, replicate=1, ac=None, mp="bf16", batch=1, seq=256, size="m"),
    dict(world=3, replicate=1, ac=None, mp=None, batch=2, seq=96, size="s"),
    dict(world=3, replicate=1, ac="selective", mp=None, batch=3, seq=64, size="m"),
    dict(world=3, replicate=1, ac="full", mp="bf16", batch=2, seq=128, size="m"),
    dict(world=3, replicate=1, ac=2, mp=None, batch=2, seq=64, size="s"),
    dict(world=4, replicate=1, ac=None, mp="bf16", batch=2, seq=128, size="m"),
    dict(world=4, replicate=1, ac="full", mp=None, batch=1, seq=256, size="s"),
    dict(world=4, replicate=2, ac=None, mp=None, batch=2, seq=64, size="s"),
    dict(world=4, replicate=2, ac="selective", mp="bf16", batch=4, seq=64, size="m"),
    dict(world=4, replicate=2, ac="full", mp="bf16", batch=2, seq=192, size="s"),
    dict(world=4, replicate=1, ac="selective", mp=None, batch=2, seq=64, size="tied"),
    # 8 blocks: the planner runs 5 and repeats the 4th (trace.py); prefetch and SGD.
    dict(world=2, replicate=1, ac=None, mp="bf16", batch=2, seq=64, size="deep", prefetch=1),
    dict(world=3, replicate=1, ac="full", mp=None, batch=2, seq=96, size="deep", optimizer="sgd"),
    dict(world=4, replicate=2, ac="selective", mp=None, batch=1, seq=16, size="deep"),
    # Tensor parallelism (the model's own transformers plan, fsdp2kit.apply_tensor_parallel):
    # alone, and under FSDP on a (shard, tp) mesh. world counts every rank.
    dict(world=2, replicate=1, ac=None, mp=None, batch=2, seq=64, size="s", tp=2),
    dict(world=2, replicate=1, ac="full", mp="bf16", batch=2, seq=96, size="m", tp=2),
    dict(world=4, replicate=1, ac=None, mp=None, batch=2, seq=64, size="s", tp=2),
    dict(world=4, replicate=1, ac="selective", mp="bf16", batch=2, seq=128, size="m", tp=2),
    # LoRA (peft, rank 8, every block Linear; fp32 adapters) over an fp32 or a bf16 base, and
    # QLoRA (the base's block Linears in NF4, torchao's default groups of 64 x 256).
    dict(world=2, replicate=1, ac=None, mp=None, batch=2, seq=64, size="s", lora=8),
    dict(world=2, replicate=1, ac="full", mp="bf16", batch=2, seq=128, size="m", lora=8),
    dict(world=2, replicate=1, ac=None, mp="bf16", batch=2, seq=64, size="q", lora=8, qlora=True),
    dict(world=2, replicate=1, ac="selective", mp="bf16", batch=2, seq=64, size="q", lora=16, qlora=True),
    # A model built in bf16 (as a bf16 checkpoint builds it): fp32 masters cast at sharding, or pure bf16.
    dict(world=2, replicate=1, ac=None, mp="bf16", batch=2, seq=64, size="s", built="bfloat16"),
    dict(world=2, replicate=1, ac="full", mp="pure_bf16", batch=2, seq=64, size="s", built="bfloat16"),
    # MoE (Qwen3-MoE, transformers' grouped-matmul experts): fp32 and bf16.
    dict(world=2, replicate=1, ac=None, mp=None, batch=2, seq=64, size="moe"),
    dict(world=2, replicate=1, ac="full", mp="bf16", batch=2, seq=96, size="moe"),
]

SIZES = {
    "s": dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "m": dict(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    "deep": dict(
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    # QLoRA: every block weight a whole number of NF4 groups (64 x 256 values) per rank at world 2
    "q": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "moe": dict(
        family="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "tied": dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=768,
        tie_word_embeddings=True,
    ),
}


def build(size: str, meta: bool, dtype: str | None = None):
    """The model of ``size``, its parameters in ``dtype`` (e.g. "bfloat16", as a bf16 checkpoint builds it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(SIZES[size])
    if kw.pop("family", "llama") == "qwen3_moe":
        config, cls = Qwen3MoeConfig(max_position_embeddings=512, **kw), Qwen3MoeForCausalLM
    else:
        config, cls = LlamaConfig(max_position_embeddings=512, **kw), LlamaForCausalLM
    with torch.device("meta" if meta else "cpu"):
        model = cls(config)
    if dtype is not None:  # the parameters only: rotary inv_freq stays fp32, as from_pretrained keeps it
        for p in model.parameters():
            p.data = p.data.to(getattr(torch, dtype))
    return model


def lm_loss(model, batch):
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def cp_loss(mesh, packed: bool = False):
    """`lm_loss` on this cp rank's part of the sequence (labels shifted before the split, as the library needs);
    ``packed``: two documents a row (positions restart half-way), so attention gets a document mask."""
    import fsdp2kit as fk

    def loss(model, batch):
        rows = {"input_ids": batch[:, :-1], "labels": batch[:, 1:]}
        if packed:
            half = rows["input_ids"].shape[1] // 2
            rows["position_ids"] = torch.arange(rows["input_ids"].shape[1]).remainder(half).expand_as(batch[:, :-1])
        part = fk.split_for_context_parallel(rows, mesh)
        logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), part["labels"].flatten())

    return loss


def measure_world(configs: list[dict]) -> list[dict]:
    """On every rank: each configuration's measured step (runs under fsdp2kit.testing.run_world)."""
    import torch.distributed as dist
    from measure_step import measure_step

    import fsdp2kit as fk

    out = []
    for c in configs:
        torch.manual_seed(0)
        model = build(c["size"], meta=False, dtype=c.get("built"))
        model.config.use_cache = False
        tp = c.get("tp", 1)
        if c.get("lora"):  # as the recipe's [lora] table: the base in the compute dtype, NF4 blocks for QLoRA
            if c["mp"] == "bf16":
                model = model.to(torch.bfloat16)
            if c.get("qlora"):
                fk.quantize_nf4(model)
            model = fk.apply_lora(model, r=c["lora"])
        cp = c.get("cp", 1)
        mesh = fk.make_mesh(shard=c["world"] // c["replicate"] // tp // cp, replicate=c["replicate"], tp=tp, cp=cp)
        if tp > 1:
            fk.apply_tensor_parallel(model, mesh)
        if cp > 1:
            fk.apply_context_parallel(model, mesh)
        if c["ac"] is not None:
            fk.apply_activation_checkpointing(model, mode=c["ac"])
        fk.shard_model(model, mesh, mixed_precision=c["mp"], replicate_adapters=c.get("replicated", False))
        if c.get("prefetch", 0):
            fk.set_prefetch(model, forward=c["prefetch"], backward=c["prefetch"])
        if c.get("optimizer", "adamw") == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        else:
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(dist.get_rank() // tp // cp)  # one batch per TP (and cp) group
        loss_fn = cp_loss(mesh, c.get("packed", False)) if cp > 1 else lm_loss

        def make_batch(vocab=vocab, shape=(c["batch"], c["seq"] + 1), gen=gen):
            return torch.randint(0, vocab, shape, generator=gen)

        loss = loss_fn(model, make_batch())  # warm-up: the optimizer state exists from here on
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        m = measure_step(
            model,
            opt,
            make_batch,
            loss_fn,
            list(model._fsdp2kit_blocks),
            micro_batches=c.get("accum", 1),
            accumulation=c.get("policy", "regather"),
        )
        out.append(m.__dict__)
        del model, opt
    return out


def predict(c: dict):
    import fsdp2kit as fk

    return fk.plan_memory(
        build(c["size"], meta=True, dtype=c.get("built")),
        shard=c["world"] // c["replicate"] // c.get("tp", 1) // c.get("cp", 1),
        tp=c.get("tp", 1),
        cp=c.get("cp", 1),
        packed=c.get("packed", False),
        lora=c.get("lora"),
        qlora=c.get("qlora", False),
        replicate=c["replicate"],
        batch=c["batch"],
        seq=c["seq"],
        activation_checkpointing=c["ac"],
        mixed_precision=c["mp"],
        device="cpu",
        prefetch=c.get("prefetch", 0),
        optimizer=c.get("optimizer", "adamw"),
        grad_accum=c.get("accum", 1),
        accumulation=c.get("policy", "regather"),
        replicate_adapters=c.get("replicated", False),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first configuration of each world size only")
    ap.add_argument("--out", default="benchmarks/results/memory_planner")
    ap.add_argument(
        "--only",
        choices=("tp", "lora", "moe", "built"),
        help="re-run only the configurations with this key, keeping the other rows of the existing --out .json",
    )
    args = ap.parse_args()
    from fsdp2kit.testing import run_world

    grid = GRID
    if args.quick:
        grid = [next(c for c in GRID if c["world"] == w) for w in (2, 3, 4)]
    if args.only:
        grid = [c for c in GRID if c.get(args.only) or c["size"] == args.only]
    rows = []
    t0 = time.time()
    for world in sorted({c["world"] for c in grid}):
        configs = [c for c in grid if c["world"] == world]
        ranks = run_world(measure_world, world, configs, timeout=900)
        for i, c in enumerate(configs):
            measured = max((r[i] for r in ranks), key=lambda m: m["peak"])
            plan = predict(c)
            rows.append(dict(config=c, predicted=plan.to_dict(), measured=measured))
            err = plan.peak_bytes / measured["peak"] - 1
            print(
                f"{c}: predicted {plan.peak_bytes} measured {measured['peak']} ({err:+.1%}) "
                f"phase {plan.phase!r} vs {measured['phase']!r}",
                flush=True,
            )
    meta = dict(
        load=os.getloadavg(), seconds=round(time.time() - t0, 1), torch=torch.__version__, python=sys.version.split()[0]
    )
    old = Path(args.out + ".json")
    if args.only and old.exists():  # the rows not re-run stay as they were measured (their run's meta too)
        previous = json.loads(old.read_text())
        fresh = {json.dumps(r["config"], sort_keys=True): r for r in rows}
        kept = {json.dumps(r["config"], sort_keys=True): r for r in previous["rows"]}
        kept.update(fresh)
        # the order of a full run: by world size (one spawn each), then as listed
        order = [json.dumps(c, sort_keys=True) for c in sorted(GRID, key=lambda c: c["world"])]
        rows = [kept[k] for k in order if k in kept]
        meta = dict(previous["meta"], **{f"{args.only}_rows": meta})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    Path(args.out + ".md").write_text(markdown(rows, meta))
    print(f"wrote {args.out}.json and .md in {meta['seconds']} s, load {meta['load']}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def _err(p: int, m: int) -> str:
    return "exact" if p == m else (f"{p / m - 1:+.2%}" if m else f"{p} vs 0")


def markdown(rows: list[dict], meta: dict) -> str:
    """The error table: the peak, then each category the planner reports, predicted vs measured."""
    head = (
        "# Memory planner vs measurement (CPU, live tensor bytes per rank)\n\n"
        "`benchmarks/memory_planner_check.py`: real gloo ranks train a tiny Llama (a Qwen3-MoE for `moe`) with "
        "fsdp2kit (the recipe's loss, AdamW unless noted; TP with `apply_tensor_parallel`'s auto plan, LoRA/QLoRA "
        "with peft adapters over a frozen base in the compute dtype, NF4 blocks for QLoRA); one step after a "
        "warm-up is measured by "
        "`measure_step` in benchmarks/measure_step.py (live storage bytes at every op, by category; the worst rank) "
        'and predicted by `fsdp2kit.plan_memory(..., device="cpu")` on the model built on the meta device. '
        f"MiB. torch {meta['torch']}, {meta['seconds']} s, load average {tuple(round(x, 1) for x in meta['load'])} "
        "(2 shared cores).\n\n"
        "| world | mesh | AC | precision | batch x seq | model | peak predicted | peak measured | error | phase "
        "(predicted / measured) | params | grads | optimizer | max gathered | max FSDP buffers "
        "| saved activations | logits + loss |\n"
        "|---|---|---|---|---|---|---:|---:|---:|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    worst = 0.0
    for r in rows:
        c, p, m = r["config"], r["predicted"], r["measured"]
        err = p["peak_bytes"] / m["peak"] - 1
        worst = max(worst, abs(err))
        tp = c.get("tp", 1)
        dp = c["world"] // tp
        mesh = f"{c['replicate']}x{dp // c['replicate']}" if c["replicate"] > 1 else f"{dp}"
        mesh += f" x tp {tp}" if tp > 1 else ""
        extra = [k for k in ("prefetch", "optimizer", "lora", "qlora", "built") if k in c]
        model = c["size"] + "".join(f", {k} {c[k]}" for k in extra)
        cats = [
            (p["parts"]["params"], m["params"]),
            (p["check"]["grads"], m["grads"]),
            (p["parts"]["optimizer"], m["optimizer"]),
            (p["check"]["max_gathered"], m["max_gathered"]),
            (p["check"]["max_comm_buffers"], m["max_comm_buffers"]),
            (p["saved_activations_bytes"], m["saved_activations"]),
            (p["logits_and_loss_bytes"], m["logits_and_loss"]),
        ]
        cells = " | ".join(f"{_mib(a)} / {_mib(b)} ({_err(a, b)})" for a, b in cats)
        lines.append(
            f"| {c['world']} | {mesh} | {c['ac'] or 'none'} | {c['mp'] or 'fp32'} | {c['batch']} x {c['seq']} | "
            f"{model} | {_mib(p['peak_bytes'])} | {_mib(m['peak'])} | {err:+.2%} | {p['phase']} / {m['phase']} | "
            f"{cells} |"
        )
    foot = (
        "\nModels: s = 4 blocks x 64 wide, vocab 512; m = 3 x 96, vocab 1024; deep = 8 x 48 (the planner runs 5 "
        "blocks and repeats one); tied = tied head; q = 2 x 256 (whole NF4 groups per rank); moe = Qwen3-MoE, "
        "3 blocks x 64, 4 experts, top 2. World counts every rank; the mesh column is the data-parallel mesh "
        "(x tp T with tensor parallelism).\n"
        f"\n{len(rows)} configurations, largest peak error {worst:.2%} (target: 10%). Category cells are "
        "predicted / measured (error). Measured categories are told apart by identity (parameter shards, "
        "`.grad`, optimizer state, FSDP2's unsharded parameters and flat all-gather / reduce-scatter buffers); "
        "saved activations are what is alive after the last block's forward besides those (the batch included), "
        "logits + loss what the loss adds up to the start of backward.\n"
    )
    return head + "\n".join(lines) + foot


if __name__ == "__main__":
    main()
