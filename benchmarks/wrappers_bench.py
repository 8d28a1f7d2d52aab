"""What each wrapper buys: tokens/s and peak memory per rank, as ratios to plain shard_model.

    torchrun --nproc_per_node=2 benchmarks/wrappers_bench.py [--rounds 5 --steps 2 --seq 256]
    python benchmarks/wrappers_bench.py [...]          # spawns the 2 gloo ranks itself

Every variant is the same Llama-style model (fsdp2kit.models "bench-256x4": hidden 256, 4 layers,
every Linear a multiple of 16 so float8 applies), from the same initial weights, trained on the
same batches, all in one process per rank. Rounds interleave the variants (the order rotates
each round) so drift in machine speed -- this machine is shared -- hits them alike; the median
over rounds is kept. One step of some variants is profiled with torch.profiler to show where
the time goes. Results: benchmarks/results/wrappers.{json,md}.

Memory, per rank, two ways (a CPU has no allocator statistics):
- step peak RSS: free memory is handed back to the OS (malloc_trim), the kernel's RSS high-water
  mark is reset (/proc/self/clear_refs), one step runs, and the peak minus the starting RSS is
  what the step added on top of what the process already held (parameters, optimizer state,
  the other variants). Real memory, including compiled kernels' buffers; noise of a few MiB.
- FSDPMemTracker (eager variants only): every tensor storage dispatched ops create, by category
  (activations, gradients, unsharded parameters...). It is a TorchDispatchMode, and under one
  compiled regions run eagerly, so for compiled variants it would report eager memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import machine as common_machine
from common import reset_rss_peak, rss_peak
from wrappers_report import write_markdown

import fsdp2kit as fk
from fsdp2kit._internal.quiet import quiet_imports

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Variant:
    float8: bool = False
    ac: str | int | None = None
    compile: bool = False
    prefetch: tuple[int, int] | None = None


VARIANTS: dict[str, Variant] = {
    "plain": Variant(),
    "prefetch 1/1": Variant(prefetch=(1, 1)),
    "prefetch 2/2": Variant(prefetch=(2, 2)),
    "AC full": Variant(ac="full"),
    "AC every 2": Variant(ac=2),
    "AC selective": Variant(ac="selective"),
    "compile": Variant(compile=True),
    "float8": Variant(float8=True),
    # candidates for the best combination; the faster one is reported as "best"
    "compile + prefetch": Variant(compile=True, prefetch=(1, 1)),
    "compile + AC selective + prefetch": Variant(ac="selective", compile=True, prefetch=(1, 1)),
    "all: float8 + AC selective + compile + prefetch": Variant(
        float8=True, ac="selective", compile=True, prefetch=(1, 1)
    ),
}
PROFILED = ["plain", "prefetch 1/1", "AC full", "AC selective", "compile", "float8"]


def _build(base, variant: Variant, mesh):
    model = copy.deepcopy(base)
    if variant.float8:
        fk.enable_float8(model)
    if variant.ac is not None:
        fk.apply_activation_checkpointing(model, variant.ac)
    if variant.compile:
        fk.compile_blocks(model)
    fk.shard_model(model, mesh)
    if variant.prefetch is not None:
        fk.set_prefetch(model, *variant.prefetch)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, tokens) -> float:
    logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _peak_memory(model, opt, tokens) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((tokens,))
    with tracker:
        _step(model, opt, tokens)
    peak = tracker.get_tracker_snapshot("peak")[tokens.device]
    named = {getattr(k, "value", str(k)): v for k, v in peak.items()}
    return {"total": named["Total"], "activations": named["Activation"] + named["Temp"], "by_kind": named}


def _step_peak_rss(model, opt, tokens, repeats: int) -> int | None:
    """Median over ``repeats`` steps of (peak RSS during the step - RSS before it); Linux only."""
    peaks = []
    for _ in range(repeats):
        start = reset_rss_peak()
        if start is None:
            return None
        _step(model, opt, tokens)
        peaks.append(rss_peak() - start)
    return int(statistics.median(peaks))


def _profile(model, opt, tokens, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, opt, tokens)
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    by_name = {e.key: e for e in averages}

    def inclusive(name: str) -> dict | None:
        e = by_name.get(name)
        return (
            None
            if e is None
            else {"calls": e.count, "ms": e.cpu_time_total / 1e3, "self_ms": e.self_cpu_time_total / 1e3}
        )

    return {
        "total_ms": total / 1e3,
        "top": [
            {
                "op": e.key,
                "self_ms": e.self_cpu_time_total / 1e3,
                "share": e.self_cpu_time_total / total,
                "calls": e.count,
            }
            for e in events[:top]
        ],
        # FSDP's own ranges (hooks, copy-in/out, waiting for a collective) and the collectives:
        # the most that overlapping communication with compute could hide.
        "fsdp_ms": sum(e.self_cpu_time_total for e in averages if e.key.startswith(("FSDP::", "c10d::"))) / 1e3,
        "mm": inclusive("aten::mm"),
        "scaled_mm": inclusive("aten::_scaled_mm"),
        "copy": inclusive("aten::copy_"),
    }


def run(args: argparse.Namespace) -> dict | None:
    from transformers import LlamaForCausalLM

    from fsdp2kit.models import llama_config

    info = fk.init_distributed()
    mesh = fk.make_mesh()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # No KV cache in training (see compile_blocks), sdpa attention (the fused CPU kernel).
    cfg = llama_config(args.model, use_cache=False, max_position_embeddings=max(args.seq, 2048))
    cfg._attn_implementation = "sdpa"
    base = LlamaForCausalLM(cfg)
    names = [n for n in VARIANTS if not args.only or n in args.only]
    gen = torch.Generator().manual_seed(1000 + rank)

    def batch():
        return torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(info.device)

    models, warmup_s, losses = {}, {}, {}
    for name in names:
        models[name] = _build(base, VARIANTS[name], mesh)
        dist.barrier()
        t0 = time.perf_counter()
        tokens = batch()
        losses[name] = [_step(*models[name], tokens) for _ in range(args.warmup)]
        dist.barrier()
        warmup_s[name] = time.perf_counter() - t0  # includes compilation for compiled variants

    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        tokens = batch()
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                _step(*models[name], tokens)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)

    memory = {}
    for name in names:
        memory[name] = {"rss": _step_peak_rss(*models[name], batch(), args.rss_repeats)}
        if not VARIANTS[name].compile:
            memory[name] |= _peak_memory(*models[name], batch())
    # Every rank profiles (the step has collectives); rank 0's profile is reported.
    profiles = {name: _profile(*models[name], batch(), args.top) for name in PROFILED if name in names}

    local = {"times": times, "memory": memory, "warmup_s": warmup_s, "losses": losses, "profiles": profiles}
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    if rank != 0:
        return None
    tokens_per_step = world * args.batch * args.seq
    results = {}
    for name in names:
        step_s = statistics.median(max(g["times"][name][i] for g in gathered) for i in range(args.rounds))
        mem = [g["memory"][name] for g in gathered]
        results[name] = {
            "variant": asdict(VARIANTS[name]),
            "step_s_median": step_s,
            "step_s_rounds": [max(g["times"][name][i] for g in gathered) for i in range(args.rounds)],
            "tokens_per_s": tokens_per_step / step_s,
            "step_peak_rss_bytes_per_rank": [m["rss"] for m in mem],
            "tracker_peak_bytes_per_rank": [m.get("total") for m in mem],
            "tracker_activation_bytes_per_rank": [m.get("activations") for m in mem],
            "tracker_by_kind_rank0": mem[0].get("by_kind"),
            "warmup_s": warmup_s[name],
            "warmup_losses_rank0": losses[name],
        }
    plain = results["plain"]

    plain_rounds = plain["step_s_rounds"]

    def ratio(res: dict, key: str) -> float | None:
        if None in res[key] or None in plain[key]:
            return None
        return max(res[key]) / max(plain[key])

    for res in results.values():
        # Paired by round: each round runs every variant back to back, so a round's ratio cancels
        # the machine's drift between rounds; the median and range over rounds are reported.
        paired = [a / b for a, b in zip(plain_rounds, res["step_s_rounds"])]
        res["speed_ratio"] = statistics.median(paired)
        res["speed_ratio_range"] = [min(paired), max(paired)]
        res["rss_ratio"] = ratio(res, "step_peak_rss_bytes_per_rank")
        res["tracker_ratio"] = ratio(res, "tracker_peak_bytes_per_rank")
        res["activation_ratio"] = ratio(res, "tracker_activation_bytes_per_rank")
    combos = [n for n in names if n.startswith(("compile +", "all:"))]
    best = max(combos, key=lambda n: results[n]["speed_ratio"]) if combos else None
    return {
        "machine": {**common_machine(), "uptime_at_end": common_machine()["uptime"]},
        "setup": {
            "model": args.model,
            "config": {
                k: getattr(cfg, k)
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                )
            },
            "params": sum(p.numel() for p in base.parameters()),
            "world": world,
            "batch_per_rank": args.batch,
            "seq": args.seq,
            "precision": "fp32 (float8 variants: float8 matmuls in the blocks)",
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "warmup_steps": args.warmup,
            "rss_repeats": args.rss_repeats,
            "threads_per_rank": torch.get_num_threads(),
            "inductor_cache": "fresh (empty) for this run"
            if "wrappers_bench_inductor_" in os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
            else os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default (may hold kernels from earlier runs)"),
        },
        "results": results,
        "best_combination": best,
        "profiles_rank0": gathered[0]["profiles"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-256x4")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=4, help="profiler rows per profiled variant")
    p.add_argument("--rss-repeats", type=int, default=3)
    p.add_argument("--notes", help="a markdown file whose text is appended to the results under 'Reading the numbers'")
    p.add_argument("--only", nargs="*", help="run only these variants (plain is always kept)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/wrappers"))
    p.add_argument("--render", metavar="JSON", help="only rewrite the markdown from a results JSON of an earlier run")
    args = p.parse_args(argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        write_markdown(res, Path(args.render).with_suffix(".md"))
        return
    if args.only is not None and "plain" not in args.only:
        args.only.append("plain")
    uptime_start = common_machine()["uptime"]
    # A fresh inductor cache, so the warm-up column shows what compiling costs on a first run
    # (inductor otherwise reuses kernels from earlier runs on this machine).
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="wrappers_bench_inductor_")
    if "RANK" in os.environ:  # under torchrun
        res = run(args)
    else:
        from fsdp2kit.testing import run_world

        res = run_world(run, 2, args, timeout=1200)[0]
    if res is None:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res["machine"]["uptime_at_start"] = uptime_start
    if args.notes:
        res["notes"] = Path(args.notes).read_text().strip()
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    write_markdown(res, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    with quiet_imports():  # torchao's import-time lines on a CPU build: this script owns the process
        main(sys.argv[1:])
