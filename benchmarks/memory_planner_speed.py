"""How long a memory plan takes here: 8B, 70B and 405B-class Llama configs at 8 to 1024 ranks.

Each model is built once on the meta device (timed apart: that is transformers' constructor),
then planned at every rank count; one step is recorded per (model, batch, seq, AC, precision)
and each rank count is a fresh `plan_memory` call, so every figure includes its own recording.
Writes benchmarks/results/memory_planner_speed.{json,md}.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/memory_planner_speed.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import fsdp2kit as fk
from fsdp2kit.models import build_causal_lm

CONFIGS = [
    ("llama3-8b", dict(batch=2, seq=8192, activation_checkpointing="selective")),
    ("llama3-70b", dict(batch=1, seq=8192, activation_checkpointing="full")),
    ("llama3-405b", dict(batch=1, seq=8192, activation_checkpointing="full")),
]
RANKS = (8, 64, 1024)


def main() -> None:
    rows = []
    for name, kw in CONFIGS:
        t = time.perf_counter()
        model = build_causal_lm(name, meta=True, max_seq_len=kw["seq"])
        build_s = time.perf_counter() - t
        for ranks in RANKS:
            t = time.perf_counter()
            plan = fk.plan_memory(model, shard=ranks, mixed_precision="bf16", name=name, **kw)
            plan_s = time.perf_counter() - t
            rows.append(
                dict(
                    model=name,
                    ranks=ranks,
                    build_s=round(build_s, 1),
                    plan_s=round(plan_s, 2),
                    peak_gib=round(plan.peak_bytes / 2**30, 1),
                    phase=plan.phase,
                    **kw,
                )
            )
            print(rows[-1], flush=True)
    load = os.getloadavg()
    Path("benchmarks/results/memory_planner_speed.json").write_text(json.dumps({"load": load, "rows": rows}, indent=1))
    lines = [
        "# Memory planner speed\n",
        f"`benchmarks/memory_planner_speed.py` on this machine (2 shared CPU cores, load average "
        f"{tuple(round(x, 1) for x in load)}). bf16, H100-style CUDA plan. Target: under 60 s a plan.\n",
        "| model | ranks | batch x seq | AC | build on meta (s) | plan (s) | predicted peak (GiB) | phase |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['batch']} x {r['seq']} | {r['activation_checkpointing']} | "
            f"{r['build_s']} | {r['plan_s']} | {r['peak_gib']} | {r['phase']} |"
        )
    Path("benchmarks/results/memory_planner_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
