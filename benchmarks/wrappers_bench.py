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
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2kit as fk  # first: quiet imports

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


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _step_peak_rss(model, opt, tokens, repeats: int) -> int | None:
    """Median over ``repeats`` steps of (peak RSS during the step - RSS before it); Linux only."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    libc = ctypes.CDLL(None)
    trim = getattr(libc, "malloc_trim", None)
    peaks = []
    for _ in range(repeats):
        if trim is not None:
            trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        start = _status_bytes("VmRSS")
        _step(model, opt, tokens)
        peaks.append(_status_bytes("VmHWM") - start)
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
        "machine": _machine(),
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


def _machine() -> dict:
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return "?"

    import torchao
    import transformers

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {
        "uname": " ".join(platform.uname()),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "uptime_at_end": sh(["uptime"]),
    }


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def write_markdown(res: dict, path: Path) -> None:
    m, s = res["machine"], res["setup"]
    lines = [
        "# Wrappers on 2 CPU ranks: tokens/s and peak memory per rank, as ratios to plain shard_model",
        "",
        "Produced by `benchmarks/wrappers_bench.py` (see its docstring for the method).",
        "",
        f"Machine: {m['cpu']}, {m['nproc']} cores (`nproc`), `{m['uname']}`; Python {m['python']}, torch {m['torch']}, "
        f"torchao {m['torchao']}, transformers {m['transformers']}; {m['date']}.",
        f"Load (`uptime`) at start: `{m['uptime_at_start']}`; at end: `{m['uptime_at_end']}`. The machine is shared with "
        "other jobs while this runs: absolute figures are not results, ratios measured side by side (interleaved "
        "rounds, median) are, and even those carry the noise of a loaded machine.",
        "",
        f"Model: Llama-style `{s['model']}` ({s['params'] / 1e6:.1f}M parameters: {s['config']}), {s['world']} ranks "
        f"(gloo, {s['threads_per_rank']} thread each), batch {s['batch_per_rank']} x {s['seq']} tokens per rank, "
        f"{s['precision']}, AdamW. {s['rounds']} interleaved rounds of {s['steps_per_round']} step(s) per variant after "
        f"{s['warmup_steps']} warm-up steps; inductor cache: {s['inductor_cache']}.",
        "",
        "| variant | tokens/s | speed vs plain | range over rounds | step peak RSS MiB/rank | vs plain | tracker peak MiB/rank "
        "| vs plain | tracker activations MiB/rank | vs plain | warm-up s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in res["results"].items():
        label = f"**{name}** (best combination)" if name == res["best_combination"] else name
        rss = r["step_peak_rss_bytes_per_rank"]
        peak, act = r["tracker_peak_bytes_per_rank"], r["tracker_activation_bytes_per_rank"]
        lines.append(
            f"| {label} | {r['tokens_per_s']:.0f} | {r['speed_ratio']:.2f} "
            f"| {r['speed_ratio_range'][0]:.2f}-{r['speed_ratio_range'][1]:.2f} "
            f"| {_mib(None if None in rss else max(rss))} | {_ratio(r['rss_ratio'])} "
            f"| {_mib(None if None in peak else max(peak))} | {_ratio(r['tracker_ratio'])} "
            f"| {_mib(None if None in act else max(act))} | {_ratio(r['activation_ratio'])} | {r['warmup_s']:.1f} |"
        )
    lines += [
        "",
        "- tokens/s: both ranks' tokens over the median (over rounds) of the slower rank's step time. Speed vs "
        "plain: per round, plain's step time over the variant's (they run back to back, so the ratio cancels drift "
        "between rounds); the median and the range over rounds. A range that straddles 1.00 is no measured effect.",
        "- step peak RSS: what one step adds to the process's resident memory at its peak (median of "
        f"{s['rss_repeats']} steps), the larger of the two ranks.",
        "- tracker: FSDPMemTracker's total at the step's peak, and its Activation + Temp categories at that "
        "moment (n/a for compiled variants, which it would measure as eager).",
        "- warm-up: the first steps, including compilation for compiled variants; a variant whose blocks share "
        "a forward with an earlier compiled variant reuses its graphs (dynamo's cache is per process).",
        "- profile: self CPU time of one step on rank 0, to see where a variant's time goes; a single step on a "
        "shared machine, so compare totals across variants with the interleaved figures above, not these. "
        "`aten::mm` calls count dispatches: the selective policy's saved outputs are dispatched again on recompute "
        "and answered from its cache, so its self ms, not its calls, is the matmul work.",
        "",
        "## Where the time goes (rank 0, one step, torch.profiler)",
        "",
        "| variant | step CPU ms | FSDP + collectives self ms | `aten::mm` calls / self ms | `aten::_scaled_mm` calls / ms (incl. the mm inside) | `aten::copy_` self ms | top self-time ops |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, p in res["profiles_rank0"].items():
        mm, smm, cp = p["mm"], p["scaled_mm"], p["copy"]
        top = "; ".join(f"`{r['op']}` {r['self_ms']:.0f} ms ({100 * r['share']:.0f}%)" for r in p["top"])
        lines.append(
            f"| {name} | {p['total_ms']:.0f} | {p['fsdp_ms']:.0f} | {mm['calls'] if mm else 0} / {mm['self_ms'] if mm else 0:.0f} "
            f"| {smm['calls'] if smm else 0} / {smm['ms'] if smm else 0:.0f} | {cp['self_ms'] if cp else 0:.0f} | {top} |"
        )
    lines += ["", "## Reading the numbers", "", *_reading(res)]
    notes = res.get("notes")
    if notes:
        lines += ["", notes]
    path.write_text("\n".join(lines) + "\n")


def _reading(res: dict) -> list[str]:
    """What the figures of this run say, with the profile numbers that explain them."""
    r, p = res["results"], res["profiles_rank0"]
    out = []

    def speed(name: str) -> str:
        if name not in r:
            return "n/a"
        lo, hi = r[name]["speed_ratio_range"]
        return f"{r[name]['speed_ratio']:.2f}x (rounds {lo:.2f}-{hi:.2f})"

    def verdict(name: str) -> str:
        lo, hi = r[name]["speed_ratio_range"]
        return (
            "faster in every round"
            if lo > 1
            else "slower in every round"
            if hi < 1
            else "no speed change beyond the noise"
        )

    def mem(name: str) -> str:
        x = r.get(name, {}).get("rss_ratio")
        return "n/a" if x is None else f"{x:.2f}x"

    if "prefetch 1/1" in r and "plain" in p:
        out.append(
            f"- **Prefetch**: depth 1 {speed('prefetch 1/1')}, {verdict('prefetch 1/1')}; depth 2 "
            f"{speed('prefetch 2/2')}, {verdict('prefetch 2/2')}. Little can be gained here: "
            f"FSDP's hooks and the collectives take {p['plain']['fsdp_ms']:.0f} of {p['plain']['total_ms']:.0f} ms of "
            "a step on rank 0, which bounds what any overlap could hide, and on CPU there is little to overlap with: "
            "no separate communication stream, and gloo's threads compete for the same 2 cores that the two ranks "
            "compute on (one thread each), so an all-gather issued earlier has no idle resource to run on. On GPUs, "
            "where NCCL runs on its own stream beside the matmuls, explicit prefetch is what lets the next blocks' "
            "all-gathers overlap compute."
        )
    if "AC full" in r and "AC full" in p:
        extra = p["AC full"]["mm"]["self_ms"] - p["plain"]["mm"]["self_ms"]
        out.append(
            f"- **Activation checkpointing** trades time for memory: full {speed('AC full')} speed for "
            f"{mem('AC full')} step memory, every 2nd block {speed('AC every 2')} / {mem('AC every 2')}, selective "
            f"{speed('AC selective')} / {mem('AC selective')}. Full recomputes each block's forward: "
            f"{p['AC full']['mm']['calls'] - p['plain']['mm']['calls']} more matmuls, +{extra:.0f} ms of `aten::mm`. "
            "Selective keeps the matmul and attention outputs, so it adds almost no matmul time and recomputes only "
            "norms, activations and element-wise ops: less memory saved, far less time spent. The saving is bounded "
            "here by what AC cannot touch: the 8192-wide logits and their log-softmax (32 MiB each per rank at this "
            "batch) live outside the blocks."
        )
    if "compile" in r and "compile" in p:
        out.append(
            f"- **Compile** gives {speed('compile')} speed ({verdict('compile')}) and {mem('compile')} step memory: the step is "
            f"{100 * p['compile']['mm']['self_ms'] / p['compile']['total_ms']:.0f}% matmul, which inductor hands to "
            "the same CPU BLAS kernel as eager, so only the element-wise and norm ops it fuses get faster "
            f"(`aten::copy_` {p['plain']['copy']['self_ms']:.0f} -> {p['compile']['copy']['self_ms']:.0f} ms) and fused "
            f"kernels keep fewer intermediates. Compiling costs {r['compile']['warmup_s']:.0f} s once per block class "
            "(one graph shared by every block: warm-up of `compile + prefetch`, same blocks, "
            f"{r.get('compile + prefetch', {}).get('warmup_s', float('nan')):.1f} s)."
        )
    if "float8" in r and "float8" in p:
        f8 = p["float8"]
        out.append(
            f"- **Float8 does not pay off on CPU** ({speed('float8')} speed, {verdict('float8')}; {mem('float8')} step memory): this CPU "
            "build has no float8 matmul kernel, so `torch._scaled_mm` upcasts its float8 operands and calls the fp32 "
            f"`aten::mm` ({f8['scaled_mm']['calls']} `_scaled_mm` calls, {f8['scaled_mm']['ms']:.0f} ms including "
            f"their mm; matmul self time {f8['mm']['self_ms']:.0f} ms vs {p['plain']['mm']['self_ms']:.0f} ms plain): "
            "the same fp32 matmul work, plus the casts to float8 and back (`aten::copy_` "
            f"{f8['copy']['self_ms']:.0f} ms vs {p['plain']['copy']['self_ms']:.0f} ms, and the abs/amax/clamp/mul of "
            "dynamic scaling) and their temporaries. Float8's gains need float8 tensor cores (H100 and later: twice "
            "bf16's matmul rate) and a bandwidth-bound all-gather (float8 all-gather sends a quarter of fp32's bytes); "
            "neither exists here. The float8 numerics are still tested here (tests/dist/test_wrappers.py)."
        )
    best = res.get("best_combination")
    if best:
        out.append(
            f"- **Best combination here: {best}**, {speed(best)} speed at {mem(best)} step memory (the fastest of the "
            "combinations measured; `compile + AC selective + prefetch` "
            f"{speed('compile + AC selective + prefetch')} / {mem('compile + AC selective + prefetch')} is the one "
            "to take when memory is what limits). "
            f"With float8 added: {speed('all: float8 + AC selective + compile + prefetch')} / "
            f"{mem('all: float8 + AC selective + compile + prefetch')} (float8's CPU cost, above)."
        )
    return out


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
    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
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
    main(sys.argv[1:])
