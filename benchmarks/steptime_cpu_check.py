"""The step-time model's sanity check on CPU: predicted vs measured step time, as ratios between configurations.

    flock /tmp/fsdp2kit-heavy.lock python benchmarks/steptime_cpu_check.py [--out benchmarks/results/steptime_cpu]

A "CPU preset" is measured first, on this machine, from microbenchmarks that are not training steps: one
thread's fp32 matmul rate at the model's shapes (its peak, efficiency 1), the copy bandwidth (for the
optimizer step) and gloo's all-gather bandwidth and latency between two ranks (its "NVLink"). Then real
FSDP2 steps (fp32, AdamW, one thread a rank) are timed for batch 1 vs 2, AC none vs full, world 1 vs 2,
interleaved, the median of the repeats kept; each is predicted by `fsdp2kit.planner.steptime` with that
preset. Absolute times on a shared 2-core CPU are no result; the ratios to the first configuration are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn.functional as F

MODEL = "bench-512x8"
SEQ = 256
# (batch, ac) run in every world; world 1 and 2.
CONFIGS = [(1, None), (2, None), (1, "full"), (2, "full")]
REPEATS = 3


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def microbenchmarks() -> dict:
    """On every rank, all ranks at once: matmul FLOP/s at the model's shapes, copy bytes/s, gloo all-gather."""
    import torch.distributed as dist

    torch.manual_seed(0)
    a, b = torch.randn(512, 512), torch.randn(512, 1376)  # a 512-token slice through the MLP's up projection
    mm = _timed(lambda: torch.mm(a, b), 40)
    big = torch.randn(8 << 20)
    dst = torch.empty_like(big)
    copy = _timed(lambda: dst.copy_(big), 5)
    out = {"flops": 2 * 512 * 512 * 1376 / mm, "copy_bytes_per_s": 2 * big.numel() * 4 / copy}
    world = dist.get_world_size()
    if world == 1:
        return out
    for n in (1 << 8, 4 << 20):  # bytes a rank contributes: a latency and a bandwidth point
        shard = torch.zeros(n // 4)
        full = torch.empty(world * shard.numel())
        dist.barrier()
        out[f"all_gather_{n}"] = _timed(lambda s=shard, f=full: dist.all_gather_into_tensor(f, s), 5)
    return out


def measure_world(configs: list[tuple[int, str | None]], repeats: int) -> dict:
    """On every rank: each configuration's median step time, the configurations interleaved, and this world's
    microbenchmarks (before and after the steps: the machine's load changes, and with it a core's rate)."""
    import torch.distributed as dist

    import fsdp2kit as fk
    from fsdp2kit.models import build_causal_lm

    models = {}
    for ac in sorted({c[1] for c in configs}, key=str):
        torch.manual_seed(0)
        model = build_causal_lm(MODEL, meta=False)
        model.config.use_cache = False
        if ac is not None:
            fk.apply_activation_checkpointing(model, mode=ac)
        fk.shard_model(model, fk.make_mesh(shard=dist.get_world_size()))
        models[ac] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(dist.get_rank())

    def step(batch: int, ac: str | None) -> float:
        model, opt = models[ac]
        ids = torch.randint(0, model.config.vocab_size, (batch, SEQ + 1), generator=gen)
        dist.barrier()
        t = time.perf_counter()
        logits = model(ids[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - t

    before = microbenchmarks()
    for c in configs:
        step(*c)  # warm-up: optimizer state, allocator
    times: dict = {c: [] for c in configs}
    for _ in range(repeats):
        for c in configs:
            times[c].append(step(*c))
    after = microbenchmarks()
    micro = {k: statistics.median([before[k], after[k]]) for k in before}
    return {"steps": {f"{b}|{ac}": statistics.median(t) for (b, ac), t in times.items()}, "micro": micro}


def cpu_preset(micro: dict, comm: dict):
    from fsdp2kit.planner.hardware import Hardware

    small, large = comm[f"all_gather_{1 << 8}"], comm[f"all_gather_{4 << 20}"]
    # all-gather over 2 ranks: each receives one rank's bytes; the small message gives the latency
    bw = (4 << 20) / max(large - small, 1e-9)
    return Hardware(
        name="cpu (measured here)",
        bf16_flops=micro["flops"],
        fp8_flops=None,
        memory_bytes=2**40,
        hbm_bytes_per_s=micro["copy_bytes_per_s"],
        nvlink_bytes_per_s=bw,
        network_bytes_per_s=bw,
        gpus_per_node=2,
        latency_s=small,
        efficiency=1.0,
        source="microbenchmarks on this machine (benchmarks/steptime_cpu_check.py)",
    )


def predict(hw, world: int, batch: int, ac: str | None) -> float:
    from fsdp2kit.models import build_causal_lm
    from fsdp2kit.planner.api import Settings
    from fsdp2kit.planner.steptime import predict_step

    s = Settings(shard=world, batch=batch, seq=SEQ, activation_checkpointing=ac, device="cpu")
    return predict_step(build_causal_lm(MODEL, meta=True), s, hw, nodes=1).step_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/steptime_cpu")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args()
    from common import cpu_name

    from fsdp2kit.testing import run_world

    t0 = time.time()
    measured, micro = {}, {}
    for world in (2, 1):
        ranks = run_world(measure_world, world, CONFIGS, args.repeats, timeout=900)
        for key in ranks[0]["steps"]:
            measured[(world, key)] = max(r["steps"][key] for r in ranks)
        micro[world] = {k: min(r["micro"][k] for r in ranks) for k in ranks[0]["micro"]}  # the slowest rank
    presets = {w: cpu_preset(micro[w], micro[2]) for w in (1, 2)}
    rows = []
    base_m = base_p = None
    for world in (1, 2):
        for batch, ac in CONFIGS:
            m = measured[(world, f"{batch}|{ac}")]
            p = predict(presets[world], world, batch, ac)
            if base_m is None:
                base_m, base_p = m, p
            rows.append(dict(world=world, batch=batch, ac=ac or "none", measured_s=m, predicted_s=p))
    for r in rows:
        r["measured_ratio"] = r["measured_s"] / base_m
        r["predicted_ratio"] = r["predicted_s"] / base_p
        r["ratio_error"] = r["predicted_ratio"] / r["measured_ratio"] - 1
    where = cpu_name()
    lines = [
        "# Step time on CPU: predicted vs measured, as ratios",
        "",
        f"`python benchmarks/steptime_cpu_check.py` on {where}, {MODEL}, seq {SEQ}, fp32, AdamW, FSDP2 over gloo, "
        f"one thread a rank; median of {args.repeats} interleaved steps; {time.time() - t0:.0f} s in all.",
        "CPU preset measured in each world, all ranks at once, before and after its steps (not fitted to them): "
        + "; ".join(
            f"world {w}: matmul {h.bf16_flops / 1e9:.1f} GFLOP/s a rank, copy {h.hbm_bytes_per_s / 1e9:.1f} GB/s"
            for w, h in presets.items()
        )
        + f"; gloo all-gather {presets[2].nvlink_bytes_per_s / 1e9:.2f} GB/s, {presets[2].latency_s * 1e3:.2f} ms "
        "a call.",
        "Ratios are to the first row. Absolute times on a shared 2-core machine are not a result.",
        "",
        "| world | batch | AC | measured s | predicted s | measured ratio | predicted ratio | ratio error |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['batch']} | {r['ac']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
            f"{r['measured_ratio']:.2f} | {r['predicted_ratio']:.2f} | {r['ratio_error']:+.1%} |"
        )
    text = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump(
            dict(machine=where, presets={w: dataclasses.asdict(h) for w, h in presets.items()}, rows=rows), f, indent=1
        )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
