"""Held-out loss of the demo model fine-tuned with each `make_optimizer` choice, against fp32 AdamW.

    python benchmarks/optim_convergence.py [--steps 300] [--nproc 2] [--out benchmarks/results/optim_convergence.md]

Runs recipes/train.py with recipes/configs/demo.toml (the `make demo` job) once per optimizer, one after
another, each on ``--nproc`` torchrun ranks with the same seed, data and schedule; 5% of the records are
held out and scored every ``--eval-every`` steps and at the end. adamw_bf16sr runs with
``parallel.mixed_precision=pure_bf16`` (bf16 parameters, stochastic rounding), the others with the
model's fp32 parameters. Writes a markdown table (final held-out loss, its difference from adamw's,
the training loss at the end; no times: a shared CPU's are no result) after every run, and keeps the
per-run JSONL logs under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [
    ("adamw", []),
    ("adamw8bit", []),
    ("adamw4bit", []),
    ("adamw_fp8", []),
    ("adamw_bf16sr", ["--parallel.mixed_precision", "pure_bf16"]),
]


def _run(name: str, extra: list[str], args, work: Path) -> dict:
    log = work / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    cmd = [
        *(["flock", args.lock] if args.lock else []),  # a shared machine: one heavy run at a time
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        str(ROOT / "recipes/train.py"), "--config", str(ROOT / "recipes/configs/demo.toml"),
        "--train.steps", str(args.steps), "--optim.name", name, *extra,
        "--eval.fraction", "0.05", "--eval.every", str(args.eval_every),
        "--checkpoint.dir", str(work / f"ckpt-{name}"), "--checkpoint.every", "0", "--checkpoint.resume", "false",
        "--export.hf_dir", "", "--log.jsonl", str(log),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval_loss" in r]
    losses = [r["loss"] for r in records if "loss" in r and "eval_loss" not in r]
    return {"eval": [(r.get("step"), r["eval_loss"]) for r in evals], "train_loss": losses[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated optimizer names (default: all five)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/optim_convergence.md"))
    p.add_argument("--work", default=str(ROOT / "outputs/optim_convergence"))
    p.add_argument("--lock", default="", help="a file to flock around each run (a machine shared with others)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    results = {}
    for name, extra in RUNS:
        if only and name not in only:
            continue
        results[name] = _run(name, extra, args, work)
        print(name, results[name], flush=True)
        (work / "results.json").write_text(json.dumps(results, indent=1))
        _write_table(results, args)  # after every run: a long series stopped midway keeps what it measured


def _write_table(results: dict, args) -> None:
    base = results.get("adamw")
    lines = [
        f"# Held-out loss per optimizer: the demo model, {args.steps} steps on {args.nproc} CPU ranks",
        "",
        f"`python benchmarks/optim_convergence.py --steps {args.steps}` on {platform.node()} "
        f"({os.cpu_count()} CPUs, shared), {time.strftime('%Y-%m-%d', time.gmtime())}. recipes/configs/demo.toml, "
        "5% of the records held out; the same seed, data order and schedule for every run.",
        "",
        "One run per optimizer: the spread between seeds was not measured, so a difference of the size",
        "of the low-bit rows' is not shown to be more than noise.",
        "",
        "| optimizer | precision | held-out loss (by step) | final vs adamw | train loss at the end |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        final = r["eval"][-1][1]
        delta = f"{final - base['eval'][-1][1]:+.4f}" if base else "-"
        curve = ", ".join(f"{s}: {v:.4f}" for s, v in r["eval"])
        precision = "pure_bf16" if name == "adamw_bf16sr" else "fp32"
        lines.append(f"| {name} | {precision} | {curve} | {delta} | {r['train_loss']:.4f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
