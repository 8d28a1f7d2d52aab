"""Bytes per optimizer step of 4 micro-batches under each accumulation policy, counted, against the minimum.

    python benchmarks/accumulation.py [--micro 4 --layers 4 --hidden 128]

Runs 4 gloo ranks on this machine (fsdp2kit.testing.run_world), a Llama-style model in bf16
mixed precision, on a 1-D mesh (shard=4) and an HSDP mesh (replicate=2 x shard=2). For each
`fsdp2kit.accumulate` policy, one optimizer step's forwards and backwards run inside
`fsdp2kit.count_collectives`; the counted bytes are set beside `fsdp2kit.plan_comm`'s
prediction and beside the fewest bytes any schedule could send holding the same memory between
micro-batches (docs/accumulation.md derives each). Bytes are per rank, each collective's whole
buffer (nccl-tests' size). Writes benchmarks/results/accumulation.md and .json.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import fsdp2kit as fk
from fsdp2kit._internal.fmt import fmt_bytes
from fsdp2kit.testing import run_world

HELD = {
    "regather": "nothing",
    "keep_gathered": "unsharded parameters (compute dtype)",
    "defer_all_reduce": "sharded partial gradient sums (reduce dtype)",
    "no_sync": "unsharded gradients (reduce dtype)",
    "keep_gathered_defer_all_reduce": "unsharded parameters, sharded partial sums",
    "keep_gathered_no_sync": "unsharded parameters and gradients",
}


def _model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def minimum(plan: fk.CommPlan, policy: str, m: int) -> int:
    """The fewest bytes a step of ``m`` micro-batches can send holding what ``policy`` holds between them.

    From one micro-batch's collectives of ``plan`` (which is for ``m`` micro-batches under ``policy``):
    parameters not held must be gathered for every forward (and again for backward where the unit
    reshards after forward); gradients not held unsharded must be reduce-scattered every micro-batch;
    the all-reduce across replicas can always wait for the last micro-batch (the sharded gradient
    accumulates every micro-batch's reduce-scattered part), so it is sent once.
    """
    per = {"forward": 0, "backward": 0, "reduce_scatter": 0, "all_reduce": 0}
    for u in plan.units:
        for c in u.collectives:
            key = c.kind if c.kind != "all_gather" else c.phase
            per[key] += c.nbytes  # one call's bytes: a micro-batch's worth
    keep = policy.startswith("keep_gathered")
    unsynced = policy in ("no_sync", "keep_gathered_no_sync")
    gathers = per["forward"] if keep else m * (per["forward"] + per["backward"])
    return gathers + (1 if unsynced else m) * per["reduce_scatter"] + per["all_reduce"]


def run(micro: int, layers: int, hidden: int) -> list[dict]:
    import torch.distributed as dist
    import torch.nn.functional as F

    rows = []
    for label, shape in (("1-D shard=4", dict(shard=4)), ("HSDP 2x2", dict(shard=2, replicate=2))):
        mesh = fk.make_mesh(**shape)
        for policy in fk.ACCUMULATION:
            if "defer_all_reduce" in policy and "replicate" not in shape:
                continue
            model = _model(layers, hidden)
            plan = fk.plan_comm(model, **shape, mixed_precision="bf16", micro_batches=micro, accumulation=policy)
            fk.shard_model(model, mesh, mixed_precision="bf16")
            gen = torch.Generator().manual_seed(dist.get_rank())
            with fk.count_collectives(mesh) as counts:
                for i in range(micro):
                    tokens = torch.randint(0, 1024, (2, 33), generator=gen)
                    with fk.accumulate(model, policy, i, micro):
                        logits = model(tokens[:, :-1]).logits
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) / micro
                        loss.backward()
            counted = {g: k for g, k in counts.by_group().items() if g in ("shard", "replicate")}
            rows.append(
                {
                    "mesh": label,
                    "policy": policy,
                    "counted": counted,
                    "counted_bytes": sum(sum(k.values()) for k in counted.values()),
                    "predicted": plan.by_group(),
                    "predicted_bytes": plan.bytes_per_step,
                    "minimum_bytes": minimum(plan, policy, micro),
                    "held_bytes": plan.held_bytes,
                }
            )
    return rows


def table(rows: list[dict], micro: int) -> str:
    lines = [
        "| mesh | policy | counted bytes / step | = predicted | minimum for its memory | counted / minimum "
        "| held between micro-batches (modelled, per rank) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        held = HELD[r["policy"]] + (f": {fmt_bytes(r['held_bytes'])}" if r["held_bytes"] else "")
        lines.append(
            f"| {r['mesh']} | {r['policy']} | {r['counted_bytes']:,} | {r['counted_bytes'] == r['predicted_bytes']} "
            f"| {r['minimum_bytes']:,} | {r['counted_bytes'] / r['minimum_bytes']:.3f} | {held} |"
        )
    return "\n".join(lines)


def budgets(rows: list[dict], micro: int, layers: int, hidden: int) -> list[dict]:
    """For each mesh and each policy's predicted peak as the budget: the policy the planner picks
    (`fsdp2kit.planner.search.pick_accumulation`), its counted bytes, and the fewest bytes any
    policy's holding allows within that budget (the minimum of each policy whose peak fits)."""
    from fsdp2kit.planner.api import Settings
    from fsdp2kit.planner.search import pick_accumulation

    out = []
    for label, shape in (("1-D shard=4", dict(shard=4)), ("HSDP 2x2", dict(shard=2, replicate=2))):
        counted = {r["policy"]: r for r in rows if r["mesh"] == label}
        s = Settings(**shape, batch=2, seq=32, mixed_precision="bf16", grad_accum=micro, device="cpu")
        model, cache = _model(layers, hidden), {}
        _, _, peaks = pick_accumulation(model, s, None, cache)
        for budget in sorted({p["peak_bytes"] for p in peaks}):
            picked, _, _ = pick_accumulation(model, s, budget, cache)
            fits = [p["policy"] for p in peaks if p["peak_bytes"] <= budget]
            best = min(counted[p]["minimum_bytes"] for p in fits)
            sent = counted[picked.accumulation]["counted_bytes"]
            out.append(dict(mesh=label, budget=budget, picked=picked.accumulation, bytes=sent, minimum=best))
    return out


def budget_table(rows: list[dict]) -> str:
    lines = [
        "| mesh | memory budget (predicted peak, per rank) | policy picked | counted bytes / step "
        "| minimum for the budget | picked / minimum |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mesh']} | {r['budget']:,} | {r['picked']} | {r['bytes']:,} | {r['minimum']:,} "
            f"| {r['bytes'] / r['minimum']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/accumulation")
    args = p.parse_args()
    rows = run_world(run, 4, args.micro, args.layers, args.hidden, timeout=600)[0]
    head = (
        f"# Bytes per optimizer step, {args.micro} micro-batches, by accumulation policy\n\n"
        f"`python benchmarks/accumulation.py --micro {args.micro} --layers {args.layers} --hidden {args.hidden}` "
        f"on {platform.machine()} CPU, 4 gloo ranks, torch {torch.__version__}: a Llama-style model "
        f"({args.layers} layers, hidden {args.hidden}, vocab 1024), bf16 mixed precision (bf16 all-gathers, "
        "fp32 reductions). Bytes per rank on the data-parallel groups, each collective's whole buffer "
        "(fsdp2kit.count_collectives); the minimum is docs/accumulation.md's for the memory the policy holds.\n\n"
    )
    picks = budgets(rows, args.micro, args.layers, args.hidden)
    head2 = (
        "\n\n## The policy the planner picks for a memory budget\n\n"
        'Each budget is one policy\'s peak as `fsdp2kit.plan_memory(..., device="cpu", grad_accum='
        f"{args.micro}, accumulation=P)` predicts it (batch 2 x 32 tokens; tests/dist/test_memory_measured.py "
        "checks such peaks against measured steps). The planner picks the policy with the fewest bytes whose "
        "peak fits; the minimum is the fewest bytes of any holding (the table above) whose policy's peak fits.\n\n"
    )
    out = Path(args.out)
    out.with_suffix(".md").write_text(head + table(rows, args.micro) + head2 + budget_table(picks) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"policies": rows, "budgets": picks}, indent=1) + "\n")
    print(table(rows, args.micro))
    print(budget_table(picks))


if __name__ == "__main__":
    main()
