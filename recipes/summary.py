"""Summarise a training run from its JSONL log (all launches that appended to it).

python recipes/summary.py outputs/demo/train.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(path: str) -> None:
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    starts = [r for r in lines if r.get("event") == "start"]
    steps = {r["step"]: r for r in lines if "loss" in r}
    if not steps:
        sys.exit(f"{path} has no training records")
    first, last = steps[min(steps)], steps[max(steps)]
    ckpt = Path(starts[-1]["config"]["checkpoint"]["dir"]).resolve() if starts else None
    print(f"summary of {path}")
    print(f"  launches       {len(starts)} (resumed at steps {[r['step'] for r in starts[1:]]})")
    print(
        f"  steps          {first['step']} -> {last['step']} on {starts[-1]['world_size'] if starts else '?'} processes"
    )
    print(f"  loss           {first['loss']:.4f} -> {last['loss']:.4f}")
    print(
        f"  tokens/s       {statistics.median(r['tokens_per_s'] for r in steps.values()):.0f}"
        " (median over logged intervals)"
    )
    evals = [r for r in lines if "eval_loss" in r]
    if evals:
        print(
            f"  held-out loss  {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}"
            f" (perplexity {evals[-1]['eval_ppl']:.2f}, steps {evals[0]['step']} -> {evals[-1]['step']})"
        )
    print(f"  peak memory    {max(r['peak_mem_gib'] for r in steps.values()):.2f} GiB per rank (max)")
    if ckpt:
        print(f"  checkpoint     {ckpt}/step_{last['step']:08d}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/demo/train.jsonl")
