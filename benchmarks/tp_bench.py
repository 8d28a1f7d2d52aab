"""FSDP 4 against FSDP 2 x TP 2 on 4 CPU ranks: tokens/s and per-rank memory for the same model and batch.

    python benchmarks/tp_bench.py [--rounds 5 --seq 128 --batch 4]   # spawns the 4 gloo ranks itself

Both layouts are built in the same 4 processes from the same initial weights and trained on the
same global batch (FSDP 4: ``batch`` sequences per rank; FSDP 2 x TP 2: ``2 * batch`` per
data-parallel group, shared by its two TP ranks). Rounds interleave the two (the order alternates)
so a shared machine's drift hits both alike; the median over rounds is kept, and the speed is
also given as the per-round ratio. Memory per rank: the bytes of parameters + gradients + AdamW
state each rank holds (summed from the local tensors after a step), and what one step adds to
the resident set at its peak (activations, gathered parameters; RSS high-water mark after a
reset, Linux only). Results: benchmarks/results/tp.{json,md}.

These are CPU figures from gloo: TP's per-layer all-reduces go through the same loopback and
cores as everything else. On GPUs they run on NVLink inside a node, which is why TP is placed
innermost there; do not read these ratios as GPU ones.
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
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2kit as fk
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit.models import build_causal_lm
from fsdp2kit.testing import run_world

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"FSDP 4": {"shard": 4}, "FSDP 2 x TP 2": {"shard": 2, "tp": 2}}


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _step(model, opt, tokens) -> None:
    logits = model(tokens[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _peak_step_rss(model, opt, tokens) -> int | None:
    if not Path("/proc/self/clear_refs").exists():
        return None
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = _status_bytes("VmRSS")
    _step(model, opt, tokens)
    return _status_bytes("VmHWM") - start


def _state_bytes(model, opt) -> int:
    local = [p.to_local() for p in model.parameters()]
    total = sum(t.numel() * t.element_size() for t in local) * 2  # parameters + gradients (same shards)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                t = v.to_local() if hasattr(v, "to_local") else v
                total += t.numel() * t.element_size()
    return total


def _rank(args: dict) -> dict:
    torch.manual_seed(0)
    base = build_causal_lm(args["model"], meta=False)
    rank = dist.get_rank()
    built = {}
    for name, sizes in LAYOUTS.items():
        mesh = fk.make_mesh(**sizes)
        model = copy.deepcopy(base)
        if "tp" in sizes:
            fk.apply_tensor_parallel(model, mesh)
        plan = fk.shard_model(model, mesh)
        coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        per_group = args["batch"] * 4 // mesh["shard"].size()
        built[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), coord["shard"], per_group, plan)
    gen = torch.Generator().manual_seed(1)
    global_batch = args["batch"] * 4
    batches = [torch.randint(0, 8192, (global_batch, args["seq"] + 1), generator=gen) for _ in range(2)]

    def local(name: str, i: int) -> torch.Tensor:
        _, _, group, per_group, _ = built[name]
        return batches[i % 2][group * per_group : (group + 1) * per_group]

    for name in LAYOUTS:  # warm-up
        model, opt, *_ = built[name]
        _step(model, opt, local(name, 0))
    times: dict[str, list[float]] = {n: [] for n in LAYOUTS}
    for r in range(args["rounds"]):
        order = list(LAYOUTS) if r % 2 == 0 else list(reversed(LAYOUTS))
        for name in order:
            model, opt, *_ = built[name]
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, opt, local(name, r))
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            times[name].append(elapsed.item())
    out = {"rank": rank, "times": times}
    for name in LAYOUTS:
        model, opt, _, _, plan = built[name]
        out[name] = {
            "state_bytes": _state_bytes(model, opt),
            "plan_state_bytes": plan.state_bytes_per_rank,
            "step_peak_rss": _peak_step_rss(model, opt, local(name, 0)),
        }
    return out


def summarize(ranks: list[dict], args: dict, load: dict) -> dict:
    times = ranks[0]["times"]
    tokens = args["batch"] * 4 * args["seq"]
    ref = "FSDP 4"
    layouts = {}
    for name in LAYOUTS:
        ratios = [a / b for a, b in zip(times[ref], times[name])]
        layouts[name] = {
            "tokens_per_s": tokens / statistics.median(times[name]),
            "speed_vs_fsdp4": statistics.median(ratios),
            "speed_range": [min(ratios), max(ratios)],
            "state_bytes_per_rank": max(r[name]["state_bytes"] for r in ranks),
            "plan_state_bytes_per_rank": ranks[0][name]["plan_state_bytes"],
            "step_peak_rss_per_rank": max((r[name]["step_peak_rss"] or 0) for r in ranks) or None,
            "step_times_s": times[name],
        }
    return {
        "setup": {**args, "world": 4, "global_batch_tokens": tokens},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **load,
        },
        "layouts": layouts,
    }


def write_markdown(res: dict, path: Path) -> None:
    s, m = res["setup"], res["machine"]
    mib = 1024 * 1024
    lines = [
        "# FSDP 4 vs FSDP 2 x TP 2 on 4 CPU ranks (CPU figures)",
        "",
        "Produced by `benchmarks/tp_bench.py` (see its docstring for the method).",
        "",
        f"Machine: {m['cores']} cores, Python {m['python']}, torch {m['torch']}; {m['when']}. "
        f"Load average (1, 5, 15 min) at start {m['load_start']}, at end {m['load_end']}: the machine is shared "
        "with other jobs and has fewer cores than ranks, so absolute figures are not results; the ratio of the "
        "two layouts, interleaved round by round, is the result, and it too carries that noise.",
        "",
        f"Model `{s['model']}` (fsdp2kit.models), fp32, AdamW; global batch {s['batch'] * 4} x {s['seq']} tokens per "
        f"step; {s['rounds']} interleaved rounds of one step each after a warm-up step.",
        "",
        "| layout | tokens/s | speed vs FSDP 4 (median, range) | params + grads + Adam MiB/rank | "
        "ShardPlan's figure MiB/rank | step peak RSS MiB/rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in res["layouts"].items():
        rss = f"{r['step_peak_rss_per_rank'] / mib:.1f}" if r["step_peak_rss_per_rank"] else "n/a"
        lines.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['speed_vs_fsdp4']:.2f} ({r['speed_range'][0]:.2f}-"
            f"{r['speed_range'][1]:.2f}) | {r['state_bytes_per_rank'] / mib:.1f} | "
            f"{r['plan_state_bytes_per_rank'] / mib:.1f} | {rss} |"
        )
    tp = res["layouts"]["FSDP 2 x TP 2"]
    lo, hi = tp["speed_range"]
    ratios = [a / b for a, b in zip(res["layouts"]["FSDP 4"]["step_times_s"], tp["step_times_s"])]
    slower = sum(r < 1.0 for r in ratios)
    verdict = (
        f"FSDP 2 x TP 2 ran at {tp['speed_vs_fsdp4']:.2f}x FSDP 4's speed (median), slower in {slower} of "
        f"{len(ratios)} rounds; the per-round ratio ranges {lo:.2f}-{hi:.2f}"
        + (", across 1.00, so this run does not establish a difference" if lo < 1.0 < hi else "")
    )
    lines += [
        "",
        f"Reading: {verdict}. Per-rank state is the same for both layouts, as it must be: each rank holds a quarter "
        "of every parameter either way (FSDP 4: a quarter of the rows; FSDP 2 x TP 2: half of a TP half). "
        "What TP changes is what is gathered and what is computed per rank: see the ShardPlan tables "
        "(`fsdp2kit plan`) for the all-gather sizes.",
        "",
        "- tokens/s: the global batch's tokens over the median step time of the slowest rank.",
        "- params + grads + Adam: the local tensors each rank holds after a step (largest rank); ShardPlan's "
        "figure is the analytic one `shard_model` printed for the same layout.",
        "- step peak RSS: what one step adds to the resident set at its peak (activations, gathered parameters, "
        "communication buffers), largest rank; a single step, so noisy by a few MiB.",
        "- On CPU/gloo the TP all-reduces (two per block forward, two backward) share the cores and loopback with "
        "the compute; on GPUs they run on NVLink. These ratios say what happens here, not on a GPU node.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench-256x4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank under FSDP 4")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = p.parse_args(argv)
    args = {"model": a.model, "rounds": a.rounds, "seq": a.seq, "batch": a.batch}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_start = [round(x, 2) for x in os.getloadavg()]
    ranks = run_world(_rank, 4, args, timeout=1800)
    res = summarize(ranks, args, {"load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()]})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tp.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, a.out / "tp.md")
    print((a.out / "tp.md").read_text())


if __name__ == "__main__":
    with quiet_imports():  # torchao's import-time lines on a CPU build: this script owns the process
        main()
