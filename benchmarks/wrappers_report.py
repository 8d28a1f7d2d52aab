"""The markdown report of wrappers_bench.py: the results table, the profile table, and the reading of both."""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_markdown"]


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
