"""A long run of the demo recipe that must not leak: per-rank memory, file descriptors and threads after warm-up.

    PYTHONPATH=. python benchmarks/soak.py [--steps 2000] [--every 100]

Runs recipes/train.py under torchrun (2 CPU ranks, the demo config, checkpoints every
``--every`` steps, resources logged every 50 steps), then compares each rank's current RSS, open
file descriptors and threads at the end with their values after warm-up (the first quarter of
the run, at least 200 steps: allocator pools, DCP's thread pool and the first checkpoint's
buffers settle by then). Writes benchmarks/results/soak.md; tests/e2e/test_soak.py runs the
same function (marked slow: `make test-all`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RSS_GROWTH_MIB = 32.0  # allowed RSS growth per rank after warm-up (allocator noise is a few MiB)


def run_soak(out: Path, steps: int = 2000, every: int = 100, log_every: int = 50) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "recipes" / "train.py"),
        "--config",
        str(ROOT / "recipes" / "configs" / "demo.toml"),
        "--data.seq_len",
        "64",
        "--train.steps",
        str(steps),
        "--checkpoint.every",
        str(every),
        "--checkpoint.dir",
        str(out / "ckpt"),
        "--log.every",
        str(log_every),
        "--log.jsonl",
        str(out / "log.jsonl"),
        "--log.progress",
        "false",
        "--log.resources",
        "true",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    load_before = os.getloadavg()
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"soak run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    records = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "rss_mib_per_rank" in r]
    warm = max(200, steps // 4)
    after = [r for r in records if r["step"] >= warm]
    first, last = after[0], after[-1]
    ranks = range(len(first["rss_mib_per_rank"]))
    per_rank = [
        {
            "rank": r,
            "rss_mib": (first["rss_mib_per_rank"][r], last["rss_mib_per_rank"][r]),
            "rss_max_after_warmup": max(x["rss_mib_per_rank"][r] for x in after),
            "open_fds": (first["open_fds_per_rank"][r], last["open_fds_per_rank"][r]),
            "py_threads": (first["py_threads_per_rank"][r], last["py_threads_per_rank"][r]),
            "os_threads": (first["os_threads_per_rank"][r], last["os_threads_per_rank"][r]),
        }
        for r in ranks
    ]
    return {
        "steps": steps,
        "every": every,
        "warm_step": first["step"],
        "last_step": last["step"],
        "seconds": seconds,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "per_rank": per_rank,
        "records": [
            {k: r[k] for k in ("step", "rss_mib_per_rank", "open_fds_per_rank", "py_threads_per_rank")} for r in records
        ],
    }


def problems(result: dict) -> list[str]:
    out = []
    for r in result["per_rank"]:
        (a, b), top = r["rss_mib"], r["rss_max_after_warmup"]
        if b - a > RSS_GROWTH_MIB:
            out.append(f"rank {r['rank']}: RSS grew {b - a:.1f} MiB after warm-up ({a:.1f} -> {b:.1f})")
        if top - a > RSS_GROWTH_MIB:
            out.append(f"rank {r['rank']}: RSS peaked {top - a:.1f} MiB above its warm-up value")
        for key in ("open_fds", "py_threads", "os_threads"):
            x, y = r[key]
            if y > x:
                out.append(f"rank {r['rank']}: {key} {x} -> {y}")
    return out


def markdown(result: dict) -> str:
    lb, la = result["load_before"], result["load_after"]
    lines = [
        "# Soak: the demo recipe, long, with checkpoints (benchmarks/soak.py)",
        "",
        f"{result['steps']} steps, a checkpoint every {result['every']}, 2 gloo ranks on CPU, seq_len 64; "
        f"{result['seconds']:.0f} s wall. Load average before {lb[0]:.1f} {lb[1]:.1f} {lb[2]:.1f}, "
        f"after {la[0]:.1f} {la[1]:.1f} {la[2]:.1f}.",
        f"Compared: step {result['warm_step']} (after warm-up) with step {result['last_step']}.",
        "",
        "| rank | RSS MiB (warm -> last) | RSS max after warm-up | open fds | Python threads | OS threads |",
        "|---:|---|---:|---|---|---|",
    ]
    for r in result["per_rank"]:
        a, b = r["rss_mib"]
        lines.append(
            f"| {r['rank']} | {a:.1f} -> {b:.1f} ({b - a:+.1f}) | {r['rss_max_after_warmup']:.1f} | "
            f"{r['open_fds'][0]:.0f} -> {r['open_fds'][1]:.0f} | {r['py_threads'][0]:.0f} -> {r['py_threads'][1]:.0f} | "
            f"{r['os_threads'][0]:.0f} -> {r['os_threads'][1]:.0f} |"
        )
    found = problems(result)
    lines += [
        "",
        "Verdict: "
        + ("; ".join(found) if found else f"no growth beyond {RSS_GROWTH_MIB:.0f} MiB RSS, no fd or thread leak."),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "soak")
    args = parser.parse_args()
    result = run_soak(args.out, args.steps, args.every)
    text = markdown(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.md").write_text(text)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
