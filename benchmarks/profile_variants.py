"""Where a step's time goes, variant by variant: torch.profiler over fsdp1_vs_fsdp2.py's variants.

    torchrun --nproc_per_node=2 benchmarks/profile_variants.py --size bench-512x8:256 --variants ddp,fsdp1,fsdp2

Each variant is built alone (the same `build_variant` and `train_step` as the benchmark), given
warm-up steps, then profiled for a few steps. Rank 0 prints, per variant, the wall time of the
profiled steps split by phase (forward, backward, optimizer; from record_function ranges), the
self time of the main thread by group (matmuls and attention; the FSDP/DDP hooks, where the
main thread waits for collectives; copies, which include packing and unpacking communication
buffers; optimizer math; everything else), the process's CPU time per step (compute and
communication threads), and the ops with the most self time. A Chrome trace per variant is written
with ``--trace-dir``.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from bench_variants import Variant, build_variant, make_batches
from fsdp1_vs_fsdp2 import load_best, parse_sizes
from torch.profiler import ProfilerActivity, profile, record_function

import fsdp2kit as fk
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit.models import build_causal_lm

# op or range name -> group, by prefix; the first match wins. The wrappers' own ranges come
# first: FSDP1 waits for its all-gathers and reduce-scatters inside its hooks, and FSDP2 inside
# its FSDP:: ranges, so their self time is mostly time spent waiting for a collective.
GROUPS = [
    (
        "matmul/attention",
        ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product", "aten::linear", "aten::matmul"),
    ),
    (
        "FSDP/DDP hooks and collective waits",
        (
            "FullyShardedDataParallel.",
            "FSDP::",
            "DistributedDataParallel.",
            "c10d::",
            "gloo:",
            "nccl:",
            "record_param_comms",
            "_c10d_functional",
            "fsdp::",
        ),
    ),
    (
        "copies (incl. packing comm buffers)",
        (
            "aten::copy_",
            "aten::split_with_sizes_copy",
            "aten::_foreach_copy",
            "aten::cat",
            "aten::_chunk_cat",
            "aten::narrow_copy",
            "aten::clone",
        ),
    ),
    ("optimizer math", ("aten::_foreach_", "aten::addcdiv", "aten::addcmul", "aten::lerp", "aten::sqrt")),
]


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "other aten ops" if name.startswith("aten::") else "other (python, autograd, DTensor dispatch)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="bench-512x8:256")
    p.add_argument("--variants", default="ddp,fsdp1,fsdp2", help="ddp, fsdp1, fsdp2, fsdp1_best, fsdp2_best")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace-dir", default=None)
    p.add_argument(
        "--collectives",
        type=int,
        default=0,
        metavar="NUMEL",
        help="instead: time all-gather, reduce-scatter and all-reduce of a unit of NUMEL fp32 parameters",
    )
    args = p.parse_args()
    # build_variant reads these
    args.ac, args.mixed_precision, args.lr, args.foreach = False, None, 1e-4, False

    info = fk.init_distributed()
    if args.collectives:
        time_collectives(args.collectives, info)
        dist.destroy_process_group()
        return
    mesh = fk.make_mesh()
    ((name, seq),) = parse_sizes(args.size)
    torch.manual_seed(0)
    base = build_causal_lm(name, max_seq_len=seq, meta=False)
    base.config.use_cache = False
    batches = make_batches(args.warmup + args.steps, base.config.vocab_size, seq, args.batch, info, 0)
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
                logits = model(tokens[:, :-1]).logits  # noqa: B023, F821 - step() runs within this iteration
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            with record_function("## backward"):
                loss.backward()
            with record_function("## optimizer"):
                opt.step()  # noqa: B023, F821 - step() runs within this iteration
                opt.zero_grad(set_to_none=True)  # noqa: B023, F821 - step() runs within this iteration

        for tokens in batches[: args.warmup]:
            step(tokens)
        dist.barrier()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
        ) as prof:
            for tokens in batches[args.warmup :]:
                step(tokens)
                dist.barrier()
        cpu_ms, wall_ms = (
            (time.process_time() - cpu0) * 1e3 / args.steps,
            (time.perf_counter() - wall0) * 1e3 / args.steps,
        )
        if args.trace_dir and info.is_main:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"{key}.json"))
        if info.is_main:
            report(v, prof, args, cpu_ms, wall_ms)
        del model, opt
        dist.barrier()
    dist.destroy_process_group()


def time_collectives(numel: int, info: fk.DistInfo, repeats: int = 10) -> None:
    """The collectives of FSDP and DDP on one unit's worth of fp32 parameters, and a memory copy
    of the same size for scale: what one FSDP unit costs per step in communication. Rounds run every collective once, in an order rotated each round, so a busy neighbour slows
    them alike; the median over rounds is kept."""
    import statistics
    import warnings

    # torch 2.13 suggests the *_single spellings; the *_tensor ones are what FSDP calls
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    world = info.world_size
    numel -= numel % world
    full = torch.randn(numel, device=info.device)
    shard, out = torch.randn(numel // world, device=info.device), torch.empty(numel // world, device=info.device)
    gathered = torch.empty(numel, device=info.device)

    mb = numel * 4 / 1e6
    ops = {
        f"all-gather ({mb / world:.1f} MB in, {mb:.1f} MB out)": lambda: dist.all_gather_into_tensor(gathered, shard),
        f"reduce-scatter ({mb:.1f} MB in, {mb / world:.1f} MB out)": lambda: dist.reduce_scatter_tensor(out, full),
        f"all-reduce ({mb:.1f} MB)": lambda: dist.all_reduce(full),
        f"memory copy ({mb:.1f} MB)": lambda: full.clone(),
    }
    names = list(ops)
    times: dict[str, list[float]] = {k: [] for k in names}
    for rnd in range(repeats + 1):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            ops[name]()
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            if rnd:
                times[name].append(time.perf_counter() - t0)
    if info.is_main:
        print(f"{world} ranks, {dist.get_backend()}, median of {repeats} interleaved rounds, load {os.getloadavg()}:")
        for name in names:
            print(f"  {1e3 * statistics.median(times[name]):8.2f} ms  {name}")


def report(v: Variant, prof, args, cpu_ms: float, wall_ms: float) -> None:
    events = prof.key_averages()
    per_step = lambda us: us / 1e3 / args.steps
    phases = {e.key: per_step(e.cpu_time_total) for e in events if e.key.startswith("## ")}
    groups: dict[str, float] = defaultdict(float)
    for e in events:
        if not e.key.startswith("## ") and not e.key.startswith("ProfilerStep"):
            groups[group_of(e.key)] += per_step(e.self_cpu_time_total)
    print(f"\n=== {v.label}: ms per step; wall {wall_ms:.0f} (profiled), process CPU {cpu_ms:.0f} ===")
    print("  phases: " + ", ".join(f"{k[3:]} {ms:.0f}" for k, ms in phases.items()))
    print(
        "  self time by group: " + ", ".join(f"{g} {ms:.0f}" for g, ms in sorted(groups.items(), key=lambda x: -x[1]))
    )
    top = sorted((e for e in events if not e.key.startswith("## ")), key=lambda e: -e.self_cpu_time_total)[: args.top]
    for e in top:
        print(f"    {per_step(e.self_cpu_time_total):8.1f} ms  {e.count // args.steps:5d} calls  {e.key}")


if __name__ == "__main__":
    with quiet_imports():  # torchao's import-time lines on a CPU build: this script owns the process
        main()
