"""What RankMonitor costs a training step: its FSDP hooks alone, and hooks plus a check on every step.

    PYTHONPATH=. python benchmarks/monitor_overhead.py [--steps 20] [--repeats 5]

Two gloo ranks on CPU train the recipe's demo model (batch 8 x 128 tokens, 2 micro-steps) in
three variants, interleaved repeat by repeat so that a change in machine load hits all three
alike: plain, `RankMonitor` hooks only (``check_every=0``), and hooks plus the cross-rank check
at every micro-step and step end (``check_every=1``, the most expensive setting). Reported, into
benchmarks/results/monitor_overhead.md with the machine's load average: the median CPU time of
the training thread per step (``time.thread_time``: on a loaded machine wall time mostly
measures the other processes) and the median wall time, each relative to plain; how many
position updates a step makes and what one costs; and what one check (a 9-integer gloo
all-gather) takes in wall time.
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


def _steps(model, opt, mon, steps: int, accum: int = 2) -> tuple[float, float]:
    g = torch.Generator().manual_seed(dist.get_rank())
    dist.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
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
    cpu = time.thread_time() - cpu
    dist.barrier()
    return (time.perf_counter() - start) / steps, cpu / steps


def measure(steps: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = build_causal_lm("demo", vocab_size=256, max_seq_len=128, meta=True)
    fk.shard_model(model, fk.make_mesh())
    fk.materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _steps(model, opt, None, 3)  # warm-up
    wall = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for v in VARIANTS:
            mon = None if v == "plain" else fk.RankMonitor(model, micro_steps=2, check_every=int(v == "hooks+check"))
            w, c = _steps(model, opt, mon, steps)
            wall[v].append(w)
            cpu[v].append(c)
            if mon:
                mon.close()

    # How many position updates a step makes, and the cost of one (a tight loop, CPU time).
    mon = fk.RankMonitor(model, micro_steps=2, check_every=0)
    calls = [0]
    original = mon._set

    def counting(phase, unit):
        calls[0] += 1
        original(phase, unit)

    mon._set = counting
    _steps(model, opt, mon, 1)
    mon._set = original
    n = 200_000
    t = time.thread_time()
    for _ in range(n):
        original("forward", "model.layers.0")
    per_update = (time.thread_time() - t) / n
    mon.close()

    # One check: the 9-integer all-gather on the monitor's own gloo group (wall time).
    mon = fk.RankMonitor(model, micro_steps=2, check_every=1)
    mon.step(0)
    checks = []
    for _ in range(50):
        t = time.perf_counter()
        mon._compare(2)
        checks.append(time.perf_counter() - t)
    mon.close()
    return {"wall": wall, "cpu": cpu, "updates_per_step": calls[0], "update_s": per_update, "check_s": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()
    res = run_world(measure, 2, args.steps, args.repeats, timeout=1800)[0]
    load_after = os.getloadavg()
    med = {k: {v: statistics.median(t) for v, t in res[k].items()} for k in ("wall", "cpu")}
    ratios = {k: {v: med[k][v] / med[k]["plain"] for v in VARIANTS} for k in ("wall", "cpu")}
    check = statistics.median(res["check_s"])
    hooks_per_step = res["updates_per_step"] * res["update_s"]
    lines = [
        "# RankMonitor overhead (benchmarks/monitor_overhead.py)",
        "",
        f"2 gloo ranks on CPU ({os.cpu_count()} cores), the demo model, batch 8 x 128, 2 micro-steps, "
        f"{args.steps} steps x {args.repeats} interleaved repeats (rank 0's figures).",
        f"Load average (1, 5, 15 min) before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
        f"after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}: a shared, loaded machine, so wall "
        "times mostly measure the other processes; the training thread's CPU time is the steadier figure.",
        "",
        "| variant | CPU time / step | relative | wall / step | relative |",
        "|---|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        lines.append(
            f"| {v} | {med['cpu'][v] * 1e3:.1f} ms | {ratios['cpu'][v]:.3f} | {med['wall'][v] * 1e3:.0f} ms | "
            f"{ratios['wall'][v]:.3f} |"
        )
    lines += [
        "",
        f"Position updates per step: {res['updates_per_step']}, {res['update_s'] * 1e9:.0f} ns each "
        f"(CPU time of a tight loop): {hooks_per_step * 1e6:.0f} us per step, "
        f"{hooks_per_step / med['cpu']['plain'] * 100:.3f}% of the plain step's CPU time.",
        f"One check (9-integer all-gather on the monitor's gloo group): median {check * 1e3:.2f} ms wall over "
        f"{len(res['check_s'])}; `check_every=1` with 2 micro-steps makes 3 per step.",
        "",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "monitor_overhead.md").write_text(text)
    (RESULTS / "monitor_overhead.json").write_text(
        json.dumps({**res, "ratios": ratios, "load": [load_before, load_after]}, indent=1)
    )


if __name__ == "__main__":
    main()
