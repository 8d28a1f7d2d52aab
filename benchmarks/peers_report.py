"""Writes benchmarks/peers.py's result as JSON, a markdown table with the issue's goals, and a PNG chart."""

from __future__ import annotations

import json
from pathlib import Path

# Issue 15, "Peers": fsdp2kit against transformers' native FSDP2, at each library's defaults.
GOALS = {
    "load_speedup": 2.0,  # fsdp2kit loads >= 2x faster (transformers' load time / fsdp2kit's)
    "load_peak_ratio": 0.6,  # fsdp2kit's per-rank load peak <= 0.6x transformers'
    "tokens_ratio": 1.05,  # fsdp2kit trains >= 1.05x transformers' tokens/s
}


def ratios(result: dict, other: str = "transformers") -> dict | None:
    """fsdp2kit against ``other``: the goal's ratios, as each load returns and once its shards are read."""
    libs = result["libraries"]
    if "fsdp2kit" not in libs or other not in libs:
        return None
    a, b = libs["fsdp2kit"], libs[other]

    def worst(key):  # the worst rank's ratio
        return max(x / y for x, y in zip(a[key], b[key], strict=True))

    out = {
        "against": other,
        "load_speedup": b["load_seconds_median"] / a["load_seconds_median"],
        "load_cpu_ratio": a["load_cpu_seconds_median"] / b["load_cpu_seconds_median"],
        # The two loads of one round ran close together: their ratio carries less of the drift.
        "load_speedup_per_round": sorted(y / x for x, y in zip(a["load_seconds"], b["load_seconds"], strict=True)),
        "load_peak_ratio": worst("load_peak_mb_per_rank"),
        "touched_speedup": b["load_touch_seconds_median"] / a["load_touch_seconds_median"],
        "touched_peak_ratio": worst("touched_peak_mb_per_rank"),
        "load_step_speedup": b["load_step_seconds_median"] / a["load_step_seconds_median"],
        "load_step_speedup_per_round": sorted(
            y / x for x, y in zip(a["load_step_seconds"], b["load_step_seconds"], strict=True)
        ),
        "first_step_peak_ratio": worst("first_step_peak_mb_per_rank"),
        "tokens_ratio": a["tokens_per_s"] / b["tokens_per_s"],
        "step_peak_ratio": worst("step_peak_mb_per_rank"),
    }
    out["met"] = {
        "load_speedup": out["load_speedup"] >= GOALS["load_speedup"],
        "load_peak_ratio": out["load_peak_ratio"] <= GOALS["load_peak_ratio"],
        "touched_speedup": out["touched_speedup"] >= GOALS["load_speedup"],
        "touched_peak_ratio": out["touched_peak_ratio"] <= GOALS["load_peak_ratio"],
        "load_step_speedup": out["load_step_speedup"] >= GOALS["load_speedup"],
        "tokens_ratio": out["tokens_ratio"] >= GOALS["tokens_ratio"],
    }
    return out


def _load(la) -> str:
    return "/".join(f"{x:.1f}" for x in la)


def _mb(values) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def markdown(result: dict) -> str:
    m, libs, r, a = result["machine"], result["libraries"], result.get("ratios"), result["args"]
    la = result["loadavg"]
    lines = [
        "# fsdp2kit against the other FSDP2 stacks",
        "",
        f"Llama `{result['config']}` ({result['parameters'] / 1e6:.1f}M parameters), saved by `save_pretrained` in "
        f"{result['checkpoint_dtype']}; {a['nproc']} ranks x 1 thread, gloo, CPU; batch {a['batch']} x {a['seq']} "
        f"tokens per rank, AdamW lr {a['lr']}, each library at its documented defaults. Loads: {a['repeats']} "
        f"rounds, each library in a fresh world, interleaved (medians; time of the slowest rank). Training: every "
        f"library in one world, {a['warmup']} warm-up + {a['steps']} timed steps each, interleaved. "
        f"Machine: {m['description']}.",
        "",
        f"Load average (1/5/15 min): {_load(la['start'])} at the start, {_load(la['after_loads'])} after the loads, "
        f"{_load(la['end'])} after training; {m['nproc']} cores, so above {m['nproc']} means other work shared the "
        "machine while these figures were measured (ratios are interleaved in one run; absolute times are not "
        "comparable across runs).",
        "",
        "| library | load s | load CPU s | + read shards s | load + 1st step s | load peak MB/rank | "
        "after read MB/rank | after 1st step MB/rank | tokens/s | step s | state MB/rank | step peak MB/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lib, x in libs.items():
        lines.append(
            f"| {lib} | {x['load_seconds_median']:.2f} | {x['load_cpu_seconds_median']:.2f} | "
            f"{x['load_touch_seconds_median']:.2f} | {x['load_step_seconds_median']:.2f} | "
            f"{_mb(x['load_peak_mb_per_rank'])} | {_mb(x['touched_peak_mb_per_rank'])} | "
            f"{_mb(x['first_step_peak_mb_per_rank'])} | {x['tokens_per_s']:.0f} | "
            f"{x['step_seconds_median']:.3f} | {_mb(x['state_mb_per_rank'])} | {_mb(x['step_peak_mb_per_rank'])} |"
        )
    for lib in result["refused"]:
        lines.append(f"| {lib} | did not shard: below | | | | | | | | | | |")
    lines += [""]
    if r:
        g = GOALS
        lines += [
            f"Against transformers' native FSDP2, issue 15's goals (load average {_load(la['after_loads'])} "
            f"after the loads, {_load(la['end'])} after training):",
            "",
            "| ratio | measured | goal | |",
            "|---|---|---|---|",
            f"| load speed-up, as each load returns (transformers' time / fsdp2kit's) | {r['load_speedup']:.2f}x "
            f"(rounds {r['load_speedup_per_round'][0]:.2f}-{r['load_speedup_per_round'][-1]:.2f}) | "
            f">= {g['load_speedup']:.1f}x | {_verdict(r['met']['load_speedup'])} |",
            f"| load CPU time (fsdp2kit / transformers; busier rank, all threads) | {r['load_cpu_ratio']:.2f}x | - | |",
            f"| load peak per rank, as returned (fsdp2kit / transformers, worst rank) | {r['load_peak_ratio']:.2f}x | "
            f"<= {g['load_peak_ratio']:.1f}x | {_verdict(r['met']['load_peak_ratio'])} |",
            f"| load speed-up, load + reading every shard byte once | {r['touched_speedup']:.2f}x | "
            f">= {g['load_speedup']:.1f}x | {_verdict(r['met']['touched_speedup'])} |",
            f"| peak per rank after that read | {r['touched_peak_ratio']:.2f}x | <= {g['load_peak_ratio']:.1f}x | "
            f"{_verdict(r['met']['touched_peak_ratio'])} |",
            f"| load speed-up, load + the first training step (both pay it; fresh worlds) | "
            f"{r['load_step_speedup']:.2f}x (rounds {r['load_step_speedup_per_round'][0]:.2f}-"
            f"{r['load_step_speedup_per_round'][-1]:.2f}) | >= {g['load_speedup']:.1f}x | "
            f"{_verdict(r['met']['load_step_speedup'])} |",
            f"| peak per rank after load + first step (fsdp2kit / transformers, worst rank) | "
            f"{r['first_step_peak_ratio']:.2f}x | - | |",
            f"| training tokens/s (fsdp2kit / transformers) | {r['tokens_ratio']:.2f}x | >= {g['tokens_ratio']:.2f}x | "
            f"{_verdict(r['met']['tokens_ratio'])} |",
            f"| step peak per rank (fsdp2kit / transformers, worst rank) | {r['step_peak_ratio']:.2f}x | - | |",
            "",
        ]
    lines += [
        "Loss agreement with fsdp2kit (same initial weights, same batches; largest relative difference, any rank):",
        "",
    ]
    for lib, ag in result["agreement"].items():
        lines.append(f"- {lib}: {ag['max']:.1e} (per step: " + ", ".join(f"{v:.0e}" for v in ag["per_step"]) + ")")
    if result["refused"] or result["accelerate_attempts"]:
        lines += ["", "Did not shard here, so not measured:", ""]
        for lib in result["refused"]:
            lines.append(f"- {lib}; what each documented way did, verbatim:")
        for attempt in result["accelerate_attempts"]:
            lines.append(f"  - {attempt}")
    lines += [
        "",
        "What each figure is (benchmarks/peers.py's docstring has the method): *load* = from an existing process",
        "group to a sharded model and its AdamW optimizer; *load CPU* = the process CPU time of that load (all\n"
        "threads, the busier rank); *+ read shards* = then reading every byte of the",
        "rank's shards once; *load + 1st step* = the load again, in another fresh world, plus its first training",
        "step (forward, backward, AdamW), which reads every shard byte whatever the load deferred;",
        "*after 1st step* = the peak rise over that load and step (a lazy load's shards are",
        "memory-mapped from the checkpoint file, as transformers' are (fsdp2kit copies into its shards); such a load",
        "reads nothing, the bytes are read when first used); *peak* = rise of the resident set's high-water mark",
        "(VmHWM) over the resident set before the load, in a fresh process (mapped file pages count once",
        "touched); *state* = parameters + AdamW state this rank holds; *step peak* = the same rise during a",
        f"training step after {a['warmup']} steps; *tokens/s* = all ranks' tokens per median step time (slowest rank).",
        "",
        f"torch {m['torch']}, transformers {m.get('transformers', '?')}, accelerate {result.get('accelerate', '?')}, "
        f"Python {m['python']}, {m['date']}; `{m['uptime']}` at the start.",
        "",
    ]
    return "\n".join(lines)


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    libs = result["libraries"]
    names = list(libs)
    colors = {"fsdp2kit": "#fd8d3c", "transformers": "#6baed6", "accelerate": "#74c476"}
    panels = [
        ("load time, s (median)", [libs[k]["load_seconds_median"] for k in names]),
        ("load + read every shard byte, s", [libs[k]["load_touch_seconds_median"] for k in names]),
        ("load + first training step, s", [libs[k]["load_step_seconds_median"] for k in names]),
        ("load peak per rank, MB (worst rank)", [max(libs[k]["load_peak_mb_per_rank"]) for k in names]),
        ("after reading the shards, MB (worst rank)", [max(libs[k]["touched_peak_mb_per_rank"]) for k in names]),
        ("training tokens/s (2 ranks)", [libs[k]["tokens_per_s"] for k in names]),
        ("step peak per rank, MB (worst rank)", [max(libs[k]["step_peak_mb_per_rank"]) for k in names]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(23, 4))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=[colors.get(k, "#999999") for k in names])
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=9)
    la = result["loadavg"]
    refused = f"; refused (did not shard on CPU): {', '.join(result['refused'])}" if result["refused"] else ""
    fig.suptitle(
        f"{result['config']} ({result['parameters'] / 1e6:.1f}M), {result['machine']['description']}; "
        f"load avg {la['start'][0]:.1f} -> {la['end'][0]:.1f}{refused}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(result: dict, stem: Path) -> None:
    try:
        import accelerate

        result["accelerate"] = accelerate.__version__
    except ImportError:
        result["accelerate"] = None
    result["ratios"] = ratios(result)
    result["goals"] = GOALS
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    chart(result, stem.with_suffix(".png"))
    print(markdown(result))
