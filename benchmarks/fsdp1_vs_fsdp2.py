"""FSDP1 vs FSDP2 (through fsdp2kit) vs DDP: throughput and memory per rank, side by side.

    torchrun --nproc_per_node=2 benchmarks/fsdp1_vs_fsdp2.py             # `make bench`: the committed CPU table
    torchrun --nproc_per_node=2 benchmarks/fsdp1_vs_fsdp2.py --search    # `make bench-search`: choose "best"
    torchrun --nproc_per_node=8 benchmarks/fsdp1_vs_fsdp2.py \\
        --sizes llama3-8b:4096 --batch 1 --mixed-precision bf16          # one 8-GPU node

For each model size of the sweep, five variants train the same Llama-style model from the same
initial weights on the same batches, in one process per rank:

- ``ddp``:        DistributedDataParallel with its defaults, the un-sharded baseline;
- ``fsdp1``:      FullyShardedDataParallel with its own defaults and fsdp2kit's units (`wrap_fsdp1`);
- ``fsdp2``:      `fsdp2kit.shard_model` with its defaults;
- ``fsdp2_no_<one>``: fsdp2kit without one of its step defaults (`bench_variants.REVERTIBLE`:
  the embedding not all-gathered in backward): what it is worth; not in the default set;
- ``fsdp1_best``/``fsdp2_best``: each library's best configuration from one grid searched for both
  (`GRID`); ``--search`` runs that search and writes benchmarks/best_configs.json, which this
  run reads, so `make bench` always runs the same thing.

Method (docs/design.md, Measuring): every variant is built first, then steps are interleaved, one
step of each variant in turn with the order rotated every round, so drift in machine speed
hits all alike. A step is timed from a barrier to its end (CUDA synchronised) on every rank,
and its time is the slowest rank's. After warm-up steps (lazy init, compilation), the median
and quartiles over the repeats are kept; tokens/s per rank is batch x seq / median step time.
Every variant's loss is recorded at every step and compared with DDP's (the loss-parity check:
fp32 variants must agree step by step).

Peak memory per rank is measured in its own phase, one variant at a time (built, stepped,
freed), by `MemTracker` (torch.distributed._tools), a dispatch mode that sums the bytes of
every live tensor storage: the equivalent of CUDA's max_memory_allocated, on any device. The
process's RSS high-water mark cannot be used: one process hosts every variant, and RSS also
counts the interpreter, libraries and freed memory the C allocator keeps. What it does not see:
memory a communication backend allocates inside its own threads, and allocator caching and
fragmentation; compiled variants are measured eager (the tracker cannot see inside compiled
kernels). On CUDA, torch.cuda.max_memory_allocated of the same phase is reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from bench_memory import measure_memory
from bench_stats import loss_parity, summarize_time, throughput_ratio
from bench_variants import GRID, REVERTIBLE, Config, Variant, build_variant, make_batches, train_step
from common import machine

import fsdp2kit as fk
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit.mfu import peak_flops, transformer_flops_per_token
from fsdp2kit.models import build_causal_lm

HERE = Path(__file__).resolve().parent
BEST_CONFIGS = HERE / "best_configs.json"

# The sweep: fsdp2kit.models.NAMED_CONFIGS names and the sequence length of each. 512x8 at 256
# and 768x6 at 512 are the sizes the reference numbers were measured at.
DEFAULT_SIZES = "bench-256x4:256,bench-512x8:256,bench-768x6:512"

# Issue 15's targets (issue 6 had best/best >= 1.15), checked in the JSON (measured ratio >= target).
TARGETS = {"fsdp2_over_fsdp1": 1.0, "best_fsdp2_over_best_fsdp1": 1.10, "fsdp2_over_ddp": 0.97}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Time: every variant, steps interleaved


def time_variants(variants: list[Variant], base: nn.Module, mesh, info, batches, args) -> dict[str, dict]:
    built = {}
    for v in variants:
        built[v.key] = build_variant(v, copy.deepcopy(base).to(info.device), mesh, info, args)
    times: dict[str, list[float]] = {v.key: [] for v in variants}
    cpu: dict[str, list[float]] = {v.key: [] for v in variants}
    losses: dict[str, list[float]] = {v.key: [] for v in variants}
    for step, tokens in enumerate(batches):
        r = step % len(variants)
        for v in variants[r:] + variants[:r]:
            model, opt = built[v.key]
            dist.barrier()
            _sync(info.device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = train_step(v, model, opt, tokens, args)
            _sync(info.device)
            times[v.key].append(time.perf_counter() - t0)
            cpu[v.key].append(time.process_time() - c0)
            losses[v.key].append(loss.item())
    del built
    gc.collect()
    # A step takes as long as its slowest rank; every rank's losses go into the parity check.
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, (times, cpu, losses))
    out = {}
    w = args.warmup
    for v in variants:
        per_step = [max(g[0][v.key][i] for g in gathered) for i in range(len(batches))]
        # CPU seconds the rank's process (compute and communication threads) spent in the step,
        # averaged over ranks: unlike wall time, barely changed by other load on a shared machine.
        cpu_step = [statistics.fmean(g[1][v.key][i] for g in gathered) for i in range(len(batches))]
        out[v.key] = {
            "step_times_s": per_step[w:],
            "warmup_times_s": per_step[:w],
            "median_cpu_s_per_step": statistics.median(cpu_step[w:]),
            "losses_per_rank": [g[2][v.key] for g in gathered],
        }
    return out


# ---------------------------------------------------------------------------------------------
# The run


def load_best(path: Path = BEST_CONFIGS) -> tuple[Config, Config, dict]:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run this script with --search first (make bench-search)")
    data = json.loads(path.read_text())
    return Config(**data["fsdp1"]), Config(**data["fsdp2"]), data


def parse_sizes(text: str) -> list[tuple[str, int]]:
    sizes = []
    for item in text.split(","):
        name, _, seq = item.partition(":")
        sizes.append((name.strip(), int(seq) if seq else 256))
    return sizes


def size_key(name: str, seq: int, sizes: list[tuple[str, int]]) -> str:
    """The results' key for a size: its config name, with the sequence length when the sweep
    has that name more than once."""
    return name if sum(n == name for n, _ in sizes) == 1 else f"{name}:{seq}"


def run_size(name: str, seq: int, variants: list[Variant], mesh, info, args, *, memory: bool) -> dict:
    torch.manual_seed(args.seed)
    base = build_causal_lm(name, max_seq_len=seq, meta=False)  # on CPU; each variant copies it
    base.config.use_cache = False  # training: no KV cache for anyone to read (and one compiled graph for all blocks)
    cfg = base.config  # a named config or a local directory's config.json
    batches = make_batches(args.warmup + args.repeats, cfg.vocab_size, seq, args.batch, info, args.seed)
    tokens_per_step = args.batch * seq
    fpt = transformer_flops_per_token(base, cfg.num_hidden_layers, cfg.hidden_size, seq)
    peak = peak_flops(info.device)

    mem: dict[str, dict] = {}
    if memory:
        for v in variants:
            m = measure_memory(v, base, mesh, info, batches, args)
            every = [None] * info.world_size
            dist.all_gather_object(every, m)
            mem[v.key] = {
                "peak_memory_bytes_per_rank": max(e["peak_bytes"] for e in every),
                "resident_bytes_per_rank": max(e["resident_bytes"] for e in every),
                "cuda_max_allocated_bytes_per_rank": max(e["cuda_max_allocated_bytes"] for e in every)
                if every[0]["cuda_max_allocated_bytes"] is not None
                else None,
                "memory_measured_eager": m["measured_eager"],
            }
            floor = fk.estimate_plan(
                base,
                shard=info.world_size,
                strategy="NO_SHARD" if v.impl == "ddp" else v.config.strategy,
                mixed_precision=None if v.impl == "ddp" else args.mixed_precision,
            )
            mem[v.key]["floor_state_bytes_per_rank"] = floor.state_bytes_per_rank
            _log(info, f"  memory {v.label:48s} peak {mem[v.key]['peak_memory_bytes_per_rank'] / 2**20:8.1f} MiB")

    _log(info, f"  timing {len(variants)} variants x {args.warmup} warm-up + {args.repeats} interleaved steps")
    timed = time_variants(variants, base, mesh, info, batches, args)
    out = {
        "model": name,
        "seq": seq,
        "batch_per_rank": args.batch,
        "tokens_per_step_per_rank": tokens_per_step,
        "n_params": sum(p.numel() for p in base.parameters()),
        "flops_per_token": fpt,
        "variants": {},
    }
    for v in variants:
        out["variants"][v.key] = {
            "impl": v.impl,
            "label": v.label,
            "config": asdict(v.config),
            **summarize_time(timed[v.key], tokens_per_step, fpt, peak),
            **mem.get(v.key, {}),
        }
    return out


def _recorded(args) -> dict:
    """The arguments as the results record them: paths relative to the repository."""
    out = dict(vars(args))
    for key in ("out_dir", "best_configs"):
        with contextlib.suppress(ValueError):  # another drive
            out[key] = os.path.relpath(out[key], HERE.parent)
    return out


def _log(info: fk.DistInfo, msg: str) -> None:
    if info.is_main:
        print(msg, flush=True)


# ratio key -> (numerator, denominator) variant keys; a ratio is reported when both ran.
RATIOS = {
    "fsdp2_over_fsdp1": ("fsdp2", "fsdp1"),
    "best_fsdp2_over_best_fsdp1": ("fsdp2_best", "fsdp1_best"),
    "fsdp2_over_ddp": ("fsdp2", "ddp"),
    "best_fsdp2_over_ddp": ("fsdp2_best", "ddp"),
    **{f"fsdp2_over_fsdp2_no_{r}": ("fsdp2", f"fsdp2_no_{r}") for r in REVERTIBLE},
}
VARIANT_KEYS = (
    "ddp",
    "fsdp1",
    "fsdp2",
    "fsdp1_best",
    "fsdp2_best",
    *(f"fsdp2_no_{r}" for r in REVERTIBLE),
)
DEFAULT_VARIANTS = VARIANT_KEYS[:5]


def bench(args, info, mesh) -> dict:
    best1, best2, best_meta = load_best(Path(args.best_configs))
    every = {
        "ddp": Variant("ddp", "ddp"),
        "fsdp1": Variant("fsdp1", "fsdp1"),
        "fsdp2": Variant("fsdp2", "fsdp2"),
        "fsdp1_best": Variant("fsdp1_best", "fsdp1", best1),
        "fsdp2_best": Variant("fsdp2_best", "fsdp2", best2),
        **{f"fsdp2_no_{r}": Variant(f"fsdp2_no_{r}", "fsdp2", Config(revert=(r,))) for r in REVERTIBLE},
    }
    keys = args.variants.split(",")
    unknown = sorted(set(keys) - set(every))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(every)}")
    variants = [every[k] for k in VARIANT_KEYS if k in keys]
    result = {
        "benchmark": "fsdp1_vs_fsdp2",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(info.device, info.world_size),
        "world_size": info.world_size,
        "args": _recorded(args),
        "best_configs": best_meta,
        "targets": TARGETS,
        "load_avg_start": os.getloadavg(),
        "sizes": {},
    }
    compiled = {v.key for v in variants if v.config.compile}
    sweep = parse_sizes(args.sizes)
    for name, seq in sweep:
        _log(info, f"{name}, seq {seq}, batch {args.batch}/rank, load average {os.getloadavg()[0]:.2f}")
        r = run_size(name, seq, variants, mesh, info, args, memory=not args.no_memory)
        vs = r["variants"]
        r["ratios"] = {k: throughput_ratio(vs[a], vs[b]) for k, (a, b) in RATIOS.items() if a in vs and b in vs}
        if not args.no_memory and "fsdp2" in vs:
            peak = lambda k: vs[k]["peak_memory_bytes_per_rank"]  # noqa: B023 - used within this iteration
            resident = lambda k: vs[k]["resident_bytes_per_rank"]  # noqa: B023 - used within this iteration
            r["memory_ratios"] = {}
            if "ddp" in vs:
                r["memory_ratios"].update(
                    fsdp2_over_ddp_peak=peak("fsdp2") / peak("ddp"),
                    fsdp2_over_ddp_resident=resident("fsdp2") / resident("ddp"),
                    fsdp2_over_ddp_floor=vs["fsdp2"]["floor_state_bytes_per_rank"]
                    / vs["ddp"]["floor_state_bytes_per_rank"],
                )
            if "fsdp1" in vs:
                r["memory_ratios"]["fsdp2_over_fsdp1_peak"] = peak("fsdp2") / peak("fsdp1")
        fp32 = args.mixed_precision in (None, "fp32")
        r["loss_parity"] = loss_parity(
            vs,
            variants[0].key,
            compiled,
            tol=args.parity_rtol if fp32 else 2e-2,
            tol_compiled=args.parity_rtol_compiled if fp32 else 2e-2,
        )
        r["load_avg_end"] = os.getloadavg()
        result["sizes"][size_key(name, seq, sweep)] = r
    result["load_avg_end"] = os.getloadavg()
    sizes = list(result["sizes"].values())
    result["verdict"] = {
        key: {
            "target": target,
            "measured": [s["ratios"][key]["ratio"] for s in sizes],
            "met": all(s["ratios"][key]["ratio"] >= target for s in sizes),
        }
        for key, target in TARGETS.items()
        if all(key in s["ratios"] for s in sizes)
    }
    result["loss_parity_ok"] = all(s["loss_parity"]["ok"] for s in sizes)
    return result


def search(args, info, mesh) -> dict:
    """Time every `GRID` configuration of each library (one library at a time, its candidates
    interleaved), and choose for each the configuration with the best geometric mean, over
    the sizes, of its speed-up over that library's defaults in the same run (per size: the
    median of the per-round speed-ups)."""
    out = {
        "benchmark": "fsdp1_vs_fsdp2 --search",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(info.device, info.world_size),
        "world_size": info.world_size,
        "args": _recorded(args),
        "grid": [asdict(c) for c in GRID],
        "load_avg_start": os.getloadavg(),
        "sizes": {},
    }
    gains: dict[str, dict[Config, list[float]]] = {"fsdp1": {c: [] for c in GRID}, "fsdp2": {c: [] for c in GRID}}
    sweep = parse_sizes(args.sizes)
    for name, seq in sweep:
        key = size_key(name, seq, sweep)
        out["sizes"][key] = {}
        for impl in ("fsdp1", "fsdp2"):
            _log(info, f"search {impl} {name}, seq {seq}, load average {os.getloadavg()[0]:.2f}")
            variants = [Variant(f"{impl}:{i}", impl, c) for i, c in enumerate(GRID)]
            r = run_size(name, seq, variants, mesh, info, args, memory=False)
            default = r["variants"][f"{impl}:0"]  # GRID[0] is the library's defaults
            rows = []
            for i, c in enumerate(GRID):
                cand = r["variants"][f"{impl}:{i}"]
                # the median of per-round speed-ups: each pairs two steps of one round, so slow
                # drift of a shared machine cancels out of the choice
                gain = throughput_ratio(cand, default)
                gains[impl][c].append(gain["round_median"])
                rows.append(
                    {
                        "config": asdict(c),
                        "label": c.describe(),
                        "median_step_s": cand["median_step_s"],
                        "speedup_over_default": gain,
                        "median_cpu_s_per_step": cand["median_cpu_s_per_step"],
                    }
                )
                _log(
                    info,
                    f"  {c.describe():40s} {cand['median_step_s'] * 1e3:8.1f} ms  x{gain['round_median']:.3f} "
                    f"({gain['round_p25']:.2f}-{gain['round_p75']:.2f})  CPU {cand['median_cpu_s_per_step'] * 1e3:.0f} ms",
                )
            out["sizes"][key][impl] = rows
    best = {}
    for impl, by_config in gains.items():
        scores = {c: math.exp(statistics.fmean(math.log(g) for g in gs)) for c, gs in by_config.items()}
        winner = max(GRID, key=lambda c: scores[c])
        best[impl] = asdict(winner)
        out[f"{impl}_geomean_speedup"] = [
            {"config": asdict(c), "label": c.describe(), "geomean": scores[c]} for c in GRID
        ]
    out["best"] = best
    out["best_labels"] = {impl: Config(**c).describe() for impl, c in best.items()}
    out["load_avg_end"] = os.getloadavg()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated NAME:SEQ (fsdp2kit.models.NAMED_CONFIGS)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6, help="interleaved rounds after warm-up")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="which to run (e.g. leave out ddp for a model whose unsharded state does not fit one GPU)",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--foreach", action="store_true", help="AdamW(foreach=True) for every variant (CUDA's default; CPU's is a loop)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", default=None, choices=[None, "fp32", "bf16", "fp16"])
    p.add_argument("--ac", action="store_true", help="full activation checkpointing of every block, in every variant")
    p.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    p.add_argument("--parity-rtol", type=float, default=1e-4, help="fp32 loss agreement with DDP, every step")
    p.add_argument(
        "--parity-rtol-compiled",
        type=float,
        default=1e-3,
        help="the same for compiled variants (fused kernels round differently)",
    )
    p.add_argument(
        "--search", action="store_true", help="choose the best configurations; writes benchmarks/best_configs.json"
    )
    p.add_argument(
        "--best-configs", default=str(BEST_CONFIGS), help="read (and with --search, written) best configurations"
    )
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--tag", default="", help="added to the output file names, for runs off the default sweep")
    args = p.parse_args()

    info = fk.init_distributed()
    mesh = fk.make_mesh()
    if info.device.type == "cpu" and torch.get_num_threads() > max(1, (os.cpu_count() or 1) // info.world_size):
        _log(info, f"note: {torch.get_num_threads()} threads per rank on {os.cpu_count()} cores; set OMP_NUM_THREADS")
    _log(
        info,
        f"{machine(info.device, info.world_size)['description']}; torch {torch.__version__}; load average {os.getloadavg()}",
    )

    result = search(args, info, mesh) if args.search else bench(args, info, mesh)
    if info.is_main:
        from bench_report import write_bench, write_search

        out_dir = Path(args.out_dir)
        if args.search:
            path = write_search(result, out_dir)
            best = {
                "fsdp1": result["best"]["fsdp1"],
                "fsdp2": result["best"]["fsdp2"],
                "chosen_by": os.path.relpath(path, HERE),
                "machine": result["machine"]["description"],
                "rule": "per library, the GRID configuration with the best geometric-mean speed-up over its defaults across the sizes",
            }
            Path(args.best_configs).write_text(json.dumps(best, indent=2) + "\n")
            print(f"best configurations -> {args.best_configs}")
        else:
            write_bench(result, out_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with quiet_imports():  # torchao's import-time lines on a CPU build: this script owns the process
        main()
