"""Checkpoint size and save time of a LoRA / QLoRA run against full fine-tuning of the same model.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lora_checkpoint.py [--world 2] [--repeats 5]

The model and modes of benchmarks/lora_memory.py (full: fp32 master weights; lora: bf16 frozen
base, r=16 fp32 adapters; qlora: the same on an NF4 base), each trained one AdamW step under
``mixed_precision="bf16"`` on real gloo ranks, then saved by `fsdp2kit.Checkpointer` (model,
optimizer, RNG; LoRA and QLoRA at its default, ``trainable_only`` for a frozen base) in
interleaved repeats: full, lora, qlora, full, ... The save time is the slowest rank's
wall time of one synchronous ``save`` (fsync and publish included); the size is the bytes of
the published step directory. Results go to benchmarks/results/lora_checkpoint.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODES = ("full", "lora", "qlora")
MB = 1e6


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(repeats: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from lora_memory import BATCH, CONFIG, SEQ, build_model

    import fsdp2kit as fk

    runs = {}
    for mode in MODES:
        model, _, _ = build_model(mode)
        fk.shard_model(model, fk.make_mesh(), mixed_precision="bf16")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        runs[mode] = (model, opt, fk.Checkpointer(Path(root) / mode, keep_last=1), trainable)
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    for step in range(1, repeats + 1):
        for mode in MODES:
            model, opt, ck, _ = runs[mode]
            dist.barrier()
            start = time.perf_counter()
            ck.save(step, model, optimizer=opt)
            took = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the save is done when the slowest rank is
            seconds[mode].append(took.item())
    out = {}
    for mode in MODES:
        model, _, ck, trainable = runs[mode]
        step_dir = Path(root) / mode / f"step_{repeats:08d}"
        out[mode] = {
            "trainable_params": trainable,
            "params": sum(p.numel() for p in model.parameters()),
            "bytes": _dir_bytes(step_dir),
            "seconds": seconds[mode],
            "median_s": statistics.median(seconds[mode]),
        }
        ck.close()
    return out


def _markdown(res: dict) -> str:
    m = res["machine"]
    full = res["modes"]["full"]
    lines = [
        "# Checkpoint size and save time: LoRA / QLoRA vs full fine-tuning",
        "",
        f"Model: the Llama-style model of lora_memory.md ({full['params'] / 1e6:.1f}M parameters), "
        f'`mixed_precision="bf16"`, AdamW, world {res["world"]} (gloo, CPU), one training step, then '
        f"`Checkpointer.save` (model + optimizer + RNG) in {res['repeats']} interleaved repeats; the time is "
        "the slowest rank's, the size the published step directory's.",
        "",
        "| mode | trainable params | step size MB | x full | save s (median) | x full |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in res["modes"].items():
        lines.append(
            f"| {mode} | {r['trainable_params'] / 1e6:.2f}M | {r['bytes'] / MB:.2f} | {r['bytes'] / full['bytes']:.3f} | "
            f"{r['median_s']:.3f} | {r['median_s'] / full['median_s']:.3f} |"
        )
    lines += [
        "",
        "A LoRA / QLoRA step holds the adapters, their AdamW state and the RNG states: the frozen base "
        "(bf16 or NF4) is not written again at every save; `fsdp2kit export-hf --base` rebuilds the model "
        "from the pretrained directory when it is needed. Full fine-tuning writes fp32 weights and two fp32 "
        "AdamW moments for every parameter. The time of a small save is mostly fixed costs (two planning "
        "collectives, fsyncs, the atomic rename), so it falls less than the size.",
        "",
        f"Machine: {m['description']}; torch {m['torch']}; {m['date']}. Load average before: "
        f"{m['load_before']}, after: {m['load_after']}.",
        "",
        "Reproduce: `PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lora_checkpoint.py`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    from common import machine as describe

    from fsdp2kit.testing import run_world

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results" / "lora_checkpoint"))
    args = p.parse_args()
    machine = {**describe(world_size=args.world), "load_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory(dir=HERE.parent) as root:  # on the work disk, not a RAM-backed /tmp
        ranks = run_world(measure, args.world, args.repeats, root, timeout=1200)
    machine["load_after"] = [round(x, 2) for x in os.getloadavg()]
    res = {"world": args.world, "repeats": args.repeats, "machine": machine, "modes": ranks[0]}
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(args.out + ".md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
