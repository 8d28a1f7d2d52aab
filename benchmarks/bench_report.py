"""Writing fsdp1_vs_fsdp2.py's results: a table on stdout, JSON, markdown and a PNG chart.

Files are named ``<benchmark>-<machine>-<date>`` under benchmarks/results/, so runs on
different machines or days sit side by side instead of overwriting each other.
"""

from __future__ import annotations

import json
from pathlib import Path

MiB = 2**20
REVERTED = ("fsdp2_no_embedding_unshard",)
ORDER = ("ddp", "fsdp1", "fsdp2", "fsdp1_best", "fsdp2_best", *REVERTED)
RATIO_NAMES = {
    "fsdp2_over_fsdp1": "FSDP2 / FSDP1, defaults",
    "best_fsdp2_over_best_fsdp1": "best FSDP2 / best FSDP1",
    "fsdp2_over_ddp": "FSDP2 / DDP, defaults",
    "best_fsdp2_over_ddp": "best FSDP2 / DDP",
    **{f"fsdp2_over_{k}": f"FSDP2 / FSDP2 without {k.removeprefix('fsdp2_no_')}" for k in REVERTED},
}
EXTRA_RATIOS = [k for k in RATIO_NAMES if k not in ("fsdp2_over_fsdp1", "best_fsdp2_over_best_fsdp1", "fsdp2_over_ddp")]


def _stem(result: dict, kind: str) -> str:
    tag = result["args"].get("tag")
    return f"{kind}{'-' + tag if tag else ''}-{result['machine']['slug']}-{result['date']}"


def _load(result: dict) -> str:
    start, end = result["load_avg_start"], result["load_avg_end"]
    return f"load average (1/5/15 min) {start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f} at start, {end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} at end"


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.0f}"


def _keys(size: dict) -> list[str]:
    return [k for k in ORDER if k in size["variants"]]


def size_rows(size: dict) -> list[list[str]]:
    vs = size["variants"]
    ref_tps = vs[_keys(size)[0]]["tokens_per_s_per_rank"]  # DDP when it ran
    rows = []
    for key in _keys(size):
        v = vs[key]
        parity = size["loss_parity"]["variants"][key]
        rows.append(
            [
                v["label"],
                f"{v['median_step_s'] * 1e3:.0f}",
                f"{v['p25_step_s'] * 1e3:.0f}-{v['p75_step_s'] * 1e3:.0f}",
                f"{v['tokens_per_s_per_rank']:.0f}",
                f"{v['tokens_per_s_per_rank'] / ref_tps:.3f}",
                f"{v['median_cpu_s_per_step'] * 1e3:.0f}",
                "-" if v["mfu"] is None else f"{100 * v['mfu']:.1f}%",
                _mib(v.get("peak_memory_bytes_per_rank")) + ("*" if v.get("memory_measured_eager") else ""),
                _mib(v.get("resident_bytes_per_rank")),
                _mib(v.get("floor_state_bytes_per_rank")),
                f"{parity['max_rel_diff']:.1e}",
            ]
        )
    return rows


def header(size: dict) -> list[str]:
    ref = "DDP" if "ddp" in size["variants"] else "row 1"
    return [
        "variant",
        "median step ms",
        "p25-p75 ms",
        "tokens/s/rank",
        f"vs {ref}",
        "CPU ms/step",
        "MFU",
        "peak MiB/rank",
        "resident MiB/rank",
        "floor MiB/rank",
        f"loss rel. diff vs {ref}",
    ]


def _text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _ratio_cells(size: dict, key: str) -> str:
    r = size["ratios"][key]
    return f"{r['ratio']:.3f} ({r['round_p25']:.2f}-{r['round_p75']:.2f})"


def _verdict_rows(result: dict) -> list[list[str]]:
    rows = []
    for key, v in result["verdict"].items():
        cells = [_ratio_cells(result["sizes"][s], key) for s in result["sizes"]]
        rows.append([RATIO_NAMES[key], f">= {v['target']:.2f}", *cells, "met" if v["met"] else "**missed**"])
    for key in EXTRA_RATIOS:
        if all(key in s["ratios"] for s in result["sizes"].values()):
            rows.append([RATIO_NAMES[key], "-", *[_ratio_cells(result["sizes"][s], key) for s in result["sizes"]], ""])
    return rows


def _configs_line(result: dict) -> str:
    b = result["best_configs"]
    return (
        f"best configurations (`--search`, the same grid for both; {b['chosen_by']}): "
        f"FSDP1 {b['fsdp1']}, FSDP2 {b['fsdp2']}"
    )


def write_bench(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / _stem(result, "fsdp1_vs_fsdp2")
    a = result["args"]

    # stdout
    print()
    print(f"{result['machine']['description']}, torch {result['machine']['torch']}; {_load(result)}")
    print(_configs_line(result))
    for name, size in result["sizes"].items():
        print(
            f"\n{name}: {size['n_params'] / 1e6:.1f}M parameters, seq {size['seq']}, batch {size['batch_per_rank']}/rank, "
            f"{len(size['variants'][_keys(size)[0]]['step_times_s'])} interleaved rounds"
        )
        print(_text_table(header(size), size_rows(size)))
    print("\nthroughput ratios (ratio of medians; quartiles of the per-round ratios) against issue 15's targets:")
    sizes = list(result["sizes"])
    vrows = _verdict_rows(result)
    widths = [max(len(str(r[i])) for r in [["ratio", "target", *sizes, ""], *vrows]) for i in range(len(sizes) + 3)]
    for r in [["ratio", "target", *sizes, ""], *vrows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(
        f"loss parity (every variant vs {next(iter(result['sizes'].values()))['loss_parity']['reference']}, every step, every rank): "
        f"{'ok' if result['loss_parity_ok'] else 'FAILED'}"
    )

    # JSON
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")

    # markdown
    md = [
        f"# FSDP1 vs FSDP2 (fsdp2kit) vs DDP: {result['machine']['description']}, {result['date']}",
        "",
        f"torch {result['machine']['torch']}, world size {result['world_size']}, {a['mixed_precision'] or 'fp32'}, "
        f"AdamW, {a['warmup']} warm-up + {a['repeats']} interleaved rounds per variant; {_load(result)}.",
        "",
        _configs_line(result) + ".",
        "",
        "## Verdict",
        "",
        _md_table(["ratio (tokens/s)", "target", *sizes, ""], vrows),
        "",
    ]
    for name, size in result["sizes"].items():
        md += [
            f"## {name}: {size['n_params'] / 1e6:.1f}M parameters, seq {size['seq']}, batch {size['batch_per_rank']} per rank",
            "",
            _md_table(header(size), size_rows(size)),
            "",
        ]
    md += [
        "Peak and resident memory are live tensor bytes per rank (MemTracker), the worst rank; the floor is "
        "parameters + gradients + Adam state per rank from `estimate_plan` (DDP: the whole model). "
        "`*`: compiled variant, memory measured eager. Loss parity: largest relative difference from DDP's loss "
        f"over every step and rank ({'all within tolerance' if result['loss_parity_ok'] else 'NOT within tolerance'}).",
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(md))

    _chart(result, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json, .md, .png")
    return stem


def _chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["sizes"])
    keys = _keys(result["sizes"][sizes[0]])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(keys)
    colors = {
        "ddp": "#7f7f7f",
        "fsdp1": "#6baed6",
        "fsdp1_best": "#08519c",
        "fsdp2": "#fd8d3c",
        "fsdp2_best": "#a63603",
        "fsdp2_no_embedding_unshard": "#238b45",
    }
    for j, key in enumerate(keys):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(sizes))]
        vs = [result["sizes"][s]["variants"][key] for s in sizes]
        # normalised to the first variant (DDP when it ran) per size, so sizes of very different
        # speed share one axis
        ddp = [result["sizes"][s]["variants"][keys[0]]["median_step_s"] for s in sizes]
        rel = [d / v["median_step_s"] for d, v in zip(ddp, vs)]
        lo = [r - d / v["p75_step_s"] for r, d, v in zip(rel, ddp, vs)]
        hi = [d / v["p25_step_s"] - r for r, d, v in zip(rel, ddp, vs)]
        ax_t.bar(xs, rel, width, yerr=[lo, hi], capsize=2, color=colors[key], label=vs[0]["label"])
        if "peak_memory_bytes_per_rank" in vs[0]:
            ax_m.bar(xs, [v["peak_memory_bytes_per_rank"] / MiB for v in vs], width, color=colors[key])
            ax_m.scatter(
                xs, [v["floor_state_bytes_per_rank"] / MiB for v in vs], marker="_", s=120, color="black", zorder=3
            )
    labels = [f"{s}\nseq {result['sizes'][s]['seq']}" for s in sizes]
    for ax in (ax_t, ax_m):
        ax.set_xticks(range(len(sizes)), labels)
    ax_t.axhline(1.0, color="black", lw=0.6)
    ax_t.set_ylabel(f"tokens/s per rank, relative to {result['sizes'][sizes[0]]['variants'][keys[0]]['label']}")
    ax_t.set_title("throughput (median, bars: p25-p75)")
    ax_m.set_ylabel("MiB per rank")
    ax_m.set_title("peak live tensor memory (ticks: params+grads+Adam floor)")
    ax_t.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{result['machine']['description']}, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_search(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = (out_dir / _stem(result, "fsdp1_vs_fsdp2-search")).with_suffix(".json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{_load(result)}")
    for impl in ("fsdp1", "fsdp2"):
        print(f"{impl}: geometric-mean speed-up over its defaults")
        for row in sorted(result[f"{impl}_geomean_speedup"], key=lambda r: -r["geomean"]):
            print(f"  {row['label']:40s} x{row['geomean']:.3f}")
        print(f"  -> best {impl}: {result['best_labels'][impl]}")
    print(f"wrote {path}")
    return path
