"""Where a step's time goes, variant by variant: torch.profiler over fsdp1_vs_fsdp2.py's variants.

    torchrun --nproc_per_node=2 benchmarks/profile_variants.py --size bench-512x8:256 --variants ddp,fsdp1,fsdp2

Each variant is built alone (the same `build_variant` and `train_step` as the benchmark), given
warm-up steps, then profiled for a few steps. Rank 0 prints, per variant, the wall time of the
profiled steps split by phase (forward, backward, optimizer; from record_function ranges), the
time the main thread spent in each group of ops (matmuls and attention, other compute, copies
that exist only to pack or unpack communication buffers, waiting for collectives, DTensor and
Python overhead), and the ops with the most self time. A Chrome trace per variant is written
with ``--trace-dir``.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections import defaultdict
from pathlib import Path

import fsdp2kit as fk  # first: quiet imports
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from fsdp1_vs_fsdp2 import Config, Variant, build_variant, load_best, make_batches, parse_sizes
from fsdp2kit.models import build_causal_lm, llama_config

# aten op name -> group, by prefix; the first match wins.
GROUPS = [
    ("matmul/attention", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product", "aten::linear", "aten::matmul")),
    ("comm wait", ("c10d::", "gloo:", "nccl:", "record_param_comms", "aten::wait", "_c10d_functional::wait")),
    ("pack/unpack copies", ("fsdp::", "aten::split_with_sizes_copy", "aten::_foreach_copy", "aten::chunk_cat", "aten::_chunk_cat", "aten::cat", "aten::copy_", "aten::narrow_copy")),
    ("optimizer math", ("aten::_foreach_", "aten::addcdiv", "aten::addcmul", "aten::lerp", "aten::sqrt", "aten::mul_", "aten::add_", "aten::div_")),
]


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "other ops" if name.startswith("aten::") else "other (python, hooks, DTensor)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="bench-512x8:256")
    p.add_argument("--variants", default="ddp,fsdp1,fsdp2", help="ddp, fsdp1, fsdp2, fsdp1_best, fsdp2_best")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace-dir", default=None)
    args = p.parse_args()
    # build_variant reads these
    args.ac, args.mixed_precision, args.lr = False, None, 1e-4

    info = fk.init_distributed()
    mesh = fk.make_mesh()
    (name, seq), = parse_sizes(args.size)
    torch.manual_seed(0)
    base = build_causal_lm(name, max_seq_len=seq, meta=False)
    batches = make_batches(args.warmup + args.steps, llama_config(name).vocab_size, seq, args.batch, info, 0)
    keys = args.variants.split(",")
    known = {"ddp": Variant("ddp", "ddp"), "fsdp1": Variant("fsdp1", "fsdp1"), "fsdp2": Variant("fsdp2", "fsdp2")}
    if any(k.endswith("_best") for k in keys):
        b1, b2, _ = load_best()
        known.update(fsdp1_best=Variant("fsdp1_best", "fsdp1", b1), fsdp2_best=Variant("fsdp2_best", "fsdp2", b2))

    for key in keys:
        v = known[key]
        model, opt = build_variant(v, copy.deepcopy(base).to(info.device), mesh, info, args)

        def step(tokens):
            with record_function("## forward"):
                logits = model(tokens[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            with record_function("## backward"):
                loss.backward()
            with record_function("## optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

        for tokens in batches[: args.warmup]:
            step(tokens)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])) as prof:
            for tokens in batches[args.warmup :]:
                step(tokens)
                dist.barrier()
        if args.trace_dir and info.is_main:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"{key}.json"))
        if info.is_main:
            report(v, prof, args)
        del model, opt
        dist.barrier()
    dist.destroy_process_group()


def report(v: Variant, prof, args) -> None:
    events = prof.key_averages()
    per_step = lambda us: us / 1e3 / args.steps  # noqa: E731  (microseconds -> ms per step)
    phases = {e.key: per_step(e.cpu_time_total) for e in events if e.key.startswith("## ")}
    groups: dict[str, float] = defaultdict(float)
    for e in events:
        if not e.key.startswith("## ") and not e.key.startswith("ProfilerStep"):
            groups[group_of(e.key)] += per_step(e.self_cpu_time_total)
    print(f"\n=== {v.label}: ms per step (main thread) ===")
    print("  phases: " + ", ".join(f"{k[3:]} {ms:.0f}" for k, ms in phases.items()))
    print("  self time by group: " + ", ".join(f"{g} {ms:.0f}" for g, ms in sorted(groups.items(), key=lambda x: -x[1])))
    top = sorted((e for e in events if not e.key.startswith("## ")), key=lambda e: -e.self_cpu_time_total)[: args.top]
    for e in top:
        print(f"    {per_step(e.self_cpu_time_total):8.1f} ms  {e.count // args.steps:5d} calls  {e.key}")


if __name__ == "__main__":
    main()
