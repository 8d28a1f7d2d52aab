"""The host step of optimizer-state offload (fsdp2kit/optim_offload.py) on this CPU, interleaved rounds, the best
of the timed calls of each round: memory bandwidth, of a plain copy into another tensor and of an in-place
scale (each byte read and written once, as the AdamW update does: a copy also reads each destination line before
writing it, which STREAM's count of 2 x its bytes leaves out); torch's AdamW update of one fp32 tensor,
single-tensor vs foreach vs fused, and the fraction of the in-place bandwidth the fused step reaches (the
planner's ``HOST_ADAMW_EFFICIENCY``); `OffloadedAdamW.step` over several tensors against the planner's offload
time with this CPU as the host. Writes benchmarks/results/host_adamw_speed.{json,md}.

    python benchmarks/host_adamw_speed.py --numel 50000000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.optim.adamw import adamw

from fsdp2kit.optim_offload import OffloadedAdamW
from fsdp2kit.planner.hardware import GPUS
from fsdp2kit.planner.steptime import offload_step_seconds

OUT = Path(__file__).parent / "results"


def best(fn, calls: int = 4) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times[1:])  # the first call warms caches and allocations


def adamw_call(kind: str, numel: int):
    param, grad, avg, avg_sq = (torch.randn(numel) for _ in range(4))
    avg_sq.abs_()
    step = torch.tensor(0.0)
    hyper = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.1, eps=1e-8, maximize=False)
    f, fe = kind == "fused" or None, kind == "foreach"
    return lambda: adamw([param], [grad], [avg], [avg_sq], [], [step], foreach=fe, fused=f, **hyper)


def offloaded_step(numel: int, tensors: int):
    """OffloadedAdamW over ``tensors`` fp32 parameters of ``numel`` elements in all, each with a gradient set
    directly (step() copies every shard, as the planner counts the transfers)."""
    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    return OffloadedAdamW(params, lr=1e-3, weight_decay=0.1).step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=50_000_000)
    p.add_argument("--tensors", type=int, default=16, help="OffloadedAdamW's parameters (numel split evenly)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel
    src, dst = torch.randn(n), torch.empty(n)
    cases = {
        "copy": lambda: dst.copy_(src),
        "in-place scale": lambda: dst.mul_(0.999),
        **{f"adamw {k}": adamw_call(k, n) for k in ("single-tensor", "foreach", "fused")},
        "OffloadedAdamW.step": offloaded_step(n, args.tensors),
    }
    times = {k: [] for k in cases}
    print(f"{n:,} fp32 parameters, {args.threads} threads")
    for r in range(args.rounds):
        for k, fn in cases.items():
            times[k].append(best(fn))
            print(f"round {r}: {k:20s} {times[k][-1] * 1e3:7.1f} ms")
    copy_bw = [2 * 4 * n / t for t in times["copy"]]  # read + written bytes (STREAM's convention)
    mem_bw = [2 * 4 * n / t for t in times["in-place scale"]]
    eff = [28 * n / t / bw for t, bw in zip(times["adamw fused"], mem_bw)]  # 28 B a parameter: see the planner
    # The planner's offload time with this CPU as the host: the in-place bandwidth for its memory, and for the
    # link the bytes a copy moves a second (OffloadedAdamW's transfers are copies here), per round
    # and the fused step's fraction of the same round
    predicted = [
        offload_step_seconds(
            4 * n, 4 * n, 8 * n, replace(GPUS["h100"], host_bytes_per_s=c / 2, host_memory_bytes_per_s=bw), e
        )
        for c, bw, e in zip(copy_bw, mem_bw, eff)
    ]
    measured = times["OffloadedAdamW.step"]
    res = {
        "numel": n,
        "tensors": args.tensors,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "seconds": times,
        "copy_bytes_per_s": copy_bw,
        "in_place_bytes_per_s": mem_bw,
        "fused_fraction_of_in_place": eff,
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "measured_over_predicted": [m / q for m, q in zip(measured, predicted)],
    }
    med = statistics.median
    lines = [
        "# Host AdamW step (optimizer-state offload) on this CPU",
        "",
        f"`python benchmarks/host_adamw_speed.py --numel {n} --threads {args.threads} --rounds {args.rounds}`, "
        f"torch {torch.__version__}, {n:,} fp32 parameters; each figure the best of 3 timed calls in a round, "
        "rounds interleaved: median (min-max) over rounds.",
        "",
        "| | ms | ns a parameter |",
        "|---|---:|---:|",
    ]
    for k, ts in times.items():
        lines.append(
            f"| {k} | {med(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) | {med(ts) / n * 1e9:.2f} |"
        )
    lines += [
        "",
        f"Bandwidth (bytes read + written): copy {med(copy_bw) / 1e9:.1f} GB/s ({min(copy_bw) / 1e9:.1f}-"
        f"{max(copy_bw) / 1e9:.1f}), in-place scale {med(mem_bw) / 1e9:.1f} GB/s ({min(mem_bw) / 1e9:.1f}-"
        f"{max(mem_bw) / 1e9:.1f}). The fused step's 28 B a parameter reach {med(eff):.2f} ({min(eff):.2f}-"
        f"{max(eff):.2f}) of it (the planner's `HOST_ADAMW_EFFICIENCY`).",
        "",
        f"`OffloadedAdamW.step` ({args.tensors} tensors, every shard copied in step): measured "
        f"{med(measured) * 1e3:.1f} ms, the planner's offload time with this CPU as the host (the round's "
        "bandwidths and fused fraction) "
        f"{med(predicted) * 1e3:.1f} ms: measured / predicted {med(res['measured_over_predicted']):.2f} "
        f"({min(res['measured_over_predicted']):.2f}-{max(res['measured_over_predicted']):.2f}).",
        "",
    ]
    print("\n".join(lines))
    if not args.no_write:
        (OUT / "host_adamw_speed.json").write_text(json.dumps(res, indent=1) + "\n")
        (OUT / "host_adamw_speed.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
