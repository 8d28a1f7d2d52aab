"""The host step of optimizer-state offload (fsdp2kit/optim_offload.py) on this CPU: torch's AdamW update of
one fp32 tensor, single-tensor vs foreach vs fused, interleaved; the best of the timed calls of each round.

    python benchmarks/host_adamw_speed.py --numel 50000000 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.optim.adamw import adamw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=50_000_000)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hyper = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.1, eps=1e-8, maximize=False)
    print(f"{args.numel:,} fp32 parameters, {args.threads} threads")
    for r in range(args.rounds):
        for kind in ("single-tensor", "foreach", "fused"):
            param, grad, avg, avg_sq = (torch.randn(args.numel) for _ in range(4))
            avg_sq.abs_()
            step = torch.tensor(0.0)
            times = []
            for _ in range(4):
                t = time.perf_counter()
                adamw(
                    [param],
                    [grad],
                    [avg],
                    [avg_sq],
                    [],
                    [step],
                    foreach=kind == "foreach",
                    fused=kind == "fused" or None,
                    **hyper,
                )
                times.append(time.perf_counter() - t)
            best = min(times[1:])
            print(f"round {r}: {kind:13s} {best * 1e3:7.1f} ms  {best / args.numel * 1e9:.2f} ns a parameter")


if __name__ == "__main__":
    main()
