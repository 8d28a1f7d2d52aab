"""Summarise a training run from its JSONL log (all launches that appended to it).

python recipes/summary.py outputs/demo/train.jsonl
python recipes/summary.py outputs/demo/train.jsonl --plans   # the last launch's memory plan and ShardPlan
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# The peak memory key per device (recipes/support/metrics.py); logs written before the rename said peak_mem_gib.
PEAK_KEYS = ("peak_alloc_gib", "peak_rss_gib", "peak_mem_gib")


def main(path: str, plans: bool = False) -> None:
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    starts = [r for r in lines if r.get("event") == "start"]
    if plans:  # what the console shows only with --log.verbose
        if not starts or "shard_plan" not in starts[-1]:
            sys.exit(f"{path} has no start event with the plans")
        print(f"{starts[-1]['memory_plan']}\n{starts[-1]['shard_plan']}")
        return
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
    key = next((k for k in PEAK_KEYS if k in last), None)
    if key:
        what = {"peak_alloc_gib": "CUDA max allocated", "peak_rss_gib": "process RSS"}.get(key, key)
        print(f"  peak memory    {max(r.get(key, 0) for r in steps.values()):.2f} GiB per rank (max; {what})")
    if ckpt:
        print(f"  checkpoint     {ckpt}/step_{last['step']:08d}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--plans"]
    main(args[0] if args else "outputs/demo/train.jsonl", plans="--plans" in sys.argv[1:])
