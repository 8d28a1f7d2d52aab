"""What RankMonitor costs a training step: its FSDP hooks alone, and hooks plus a check on every step.

    PYTHONPATH=. python benchmarks/monitor_overhead.py [--steps 20] [--repeats 5]

Two gloo ranks on CPU train the recipe's demo model (batch 8 x 128 tokens, 2 micro-steps) in
three variants, interleaved repeat by repeat so that a change in machine load hits all three
alike: plain, `RankMonitor` hooks only (``check_every=0``), and hooks plus the cross-rank check
at every micro-step and step end (``check_every=1``, the most expensive setting). Reported: the
median step time of each variant relative to plain, and the machine's load average, into
benchmarks/results/monitor_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2kit as fk
from fsdp2kit.models import build_causal_lm
from fsdp2kit.testing import run_world

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("plain", "hooks", "hooks+check")


def _steps(model, opt, mon, steps: int, accum: int = 2) -> float:
    g = torch.Generator().manual_seed(dist.get_rank())
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        if mon:
            mon.step(step)
        for i in range(accum):
            batch = torch.randint(0, 256, (8, 129), generator=g)
            if mon:
                mon.micro_step(i, batch)
            with fk.no_sync(model) if i < accum - 1 else torch.enable_grad():
                logits = model(batch[:, :-1]).logits
                (F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) / accum).backward()
        if mon:
            mon.step_end()
            mon.phase("optimizer")
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def measure(steps: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = build_causal_lm("demo", vocab_size=256, max_seq_len=128, meta=True)
    fk.shard_model(model, fk.make_mesh())
    fk.materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _steps(model, opt, None, 3)  # warm-up
    times = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        times["plain"].append(_steps(model, opt, None, steps))
        mon = fk.RankMonitor(model, micro_steps=2, check_every=0)
        times["hooks"].append(_steps(model, opt, mon, steps))
        mon.close()
        mon = fk.RankMonitor(model, micro_steps=2, check_every=1)
        times["hooks+check"].append(_steps(model, opt, mon, steps))
        mon.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()
    times = run_world(measure, 2, args.steps, args.repeats, timeout=1800)[0]
    load_after = os.getloadavg()
    median = {v: statistics.median(t) for v, t in times.items()}
    ratios = {v: median[v] / median["plain"] for v in VARIANTS}
    lines = [
        "# RankMonitor overhead (benchmarks/monitor_overhead.py)",
        "",
        f"2 gloo ranks on CPU ({os.cpu_count()} cores), the demo model, batch 8 x 128, 2 micro-steps, "
        f"{args.steps} steps x {args.repeats} interleaved repeats; median step time relative to plain.",
        f"Load average (1, 5, 15 min) before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
        f"after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f} (a shared machine: ratios, not times).",
        "",
        "| variant | median step | relative to plain | all repeats (ms) |",
        "|---|---:|---:|---|",
    ]
    for v in VARIANTS:
        reps = ", ".join(f"{t * 1e3:.0f}" for t in times[v])
        lines.append(f"| {v} | {median[v] * 1e3:.1f} ms | {ratios[v]:.3f} | {reps} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "monitor_overhead.md").write_text(text)
    (RESULTS / "monitor_overhead.json").write_text(
        json.dumps({"times_s": times, "ratios": ratios, "load": [load_before, load_after]}, indent=1)
    )


if __name__ == "__main__":
    main()
