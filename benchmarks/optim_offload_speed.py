"""Tokens/s of AdamW with its state on the device, optimizer-state offload, and all-or-nothing CPU offload.

The three variants are built side by side in one process per rank (``shard_model(cpu_offload=)``,
``make_optimizer(offload=)``) and stepped in interleaved rounds (the order rotates each round);
a round's figure is its median step, a variant's the median round. `gpu_bench.py` (``make gpu-check``) runs all three on a
GPU. On CPU ranks state offload is refused (``make_optimizer(offload=True)`` needs CUDA
parameters: there is no device/host split), and ``cpu_offload`` keeps in host memory what is in
host memory already, so the CPU ratio only bounds FSDP2's offload bookkeeping. Writes
benchmarks/results/optim_offload_speed.{json,md}.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        benchmarks/optim_offload_speed.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from gpu_report import sync

import fsdp2kit as fk

VARIANTS = {"none": {}, "state offload": {"offload": True}, "cpu_offload": {"cpu_offload": True}}


def measure(build, *, batch: int, seq: int, vocab: int, rounds: int, steps: int, mp: str | None, device) -> dict:
    """``build()`` -> a model on the meta device. Per variant: median seconds a step, tokens/s, or why not."""
    setups, out = {}, {}
    for name, v in VARIANTS.items():
        model = build()
        fk.shard_model(model, fk.make_mesh(), mixed_precision=mp, cpu_offload=v.get("cpu_offload", False))
        fk.materialize(model)
        try:
            opt = fk.make_optimizer(model, "adamw", lr=1e-5, offload=v.get("offload", False))
        except ValueError as e:  # state offload on CPU ranks
            why = "needs CUDA parameters" if device.type == "cpu" else str(e)
            out[name] = {"status": f"refused: make_optimizer(offload=True) {why}"}
            continue
        setups[name] = (model, opt, [])
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())

    def step(model, opt) -> float:
        tokens = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
        sync(device)
        t0 = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    for model, opt, _ in setups.values():  # warm-up: the state exists
        step(model, opt)
    names = list(setups)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model, opt, times = setups[name]
            times.append(statistics.median(step(model, opt) for _ in range(steps)))
    world = dist.get_world_size()
    for name, (_, _, times) in setups.items():
        t = statistics.median(times)
        ratios = sorted(a / b for a, b in zip(setups["none"][2], times))  # this round's none / this variant's
        out[name] = {"status": "ok", "step_s": t, "tokens_per_s": batch * seq * world / t, "round_s": times}
        out[name]["vs_none"] = [statistics.median(ratios), ratios[0], ratios[-1]]
    return {name: out[name] for name in VARIANTS}


def markdown(rows: dict, meta: dict) -> str:
    lines = [
        "# AdamW state on the device vs optimizer-state offload vs CPU offload: tokens/s\n",
        f"`benchmarks/optim_offload_speed.py`: {meta['what']}; {meta['rounds']} interleaved rounds of "
        f"{meta['steps']} steps each. {meta['machine']}, torch {meta['torch']}, world {meta['world']}, "
        f"load average {meta['load']}.\n",
        "| variant | tokens/s | vs none: median of the rounds' ratios [range] |",
        "|---|---:|---:|",
    ]
    for name, r in rows.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} | |")
        else:
            mid, lo, hi = r["vs_none"]
            lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {mid:.2f} [{lo:.2f}, {hi:.2f}] |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="q", help="a model of benchmarks/memory_planner_check.py")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/optim_offload_speed")
    args = ap.parse_args()
    from memory_planner_check import SIZES, build

    info = fk.init_distributed()
    rows = measure(
        lambda: build(args.size, meta=True),
        batch=args.batch,
        seq=args.seq,
        vocab=SIZES[args.size]["vocab_size"],
        rounds=args.rounds,
        steps=args.steps,
        mp=None,
        device=info.device,
    )
    if dist.get_rank() == 0:
        meta = dict(
            what=f"the '{args.size}' Llama of memory_planner_check.py, fp32, batch {args.batch} x seq {args.seq}",
            rounds=args.rounds,
            steps=args.steps,
            machine=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, gloo)",
            torch=torch.__version__,
            world=dist.get_world_size(),
            load=tuple(round(x, 1) for x in os.getloadavg()),
        )
        Path(args.out + ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        Path(args.out + ".md").write_text(markdown(rows, meta))
        print(markdown(rows, meta))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
