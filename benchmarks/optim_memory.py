"""Memory per rank, measured against the planner, for every `make_optimizer` choice (CPU, gloo, world 2 and 4).

Real gloo ranks train a small Llama (the "q" model of memory_planner_check.py: every block weight's
local shard is at least 4096 elements and a whole number of torchao's blocks at world 2 and 4, so
the low-bit states really are quantized) with fsdp2kit as the recipe does, the optimizer built by
`fk.make_optimizer`. After a warm-up step one step is measured:

- forward and backward by `measure_step` (live tensor storage bytes at every op, by category);
- the optimizer step outside that dispatch mode (torchao's step is a ``torch.compile(fullgraph=True)``
  function, which does not trace under it), by torch.profiler's memory timeline: the highest
  bytes the step allocates above what was live when it started (inductor's own buffers included).

The prediction is `fsdp2kit.plan_memory(..., optimizer=NAME, device="cpu")` on the model built on the
meta device. Optimizer-state offload (``offload=True``) is not measured: it needs a CUDA device
(the state moves from the GPU to pinned host memory), which this CPU machine does not have.
Writes benchmarks/results/optim_memory.{json,md}.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/optim_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))

CHOICES = [("adamw", "bf16"), ("adamw8bit", "bf16"), ("adamw4bit", "bf16"), ("adamw_fp8", "bf16")]
CHOICES += [("adamw_bf16sr", "pure_bf16")]
GRID = [
    dict(world=w, replicate=1, ac=None, mp=mp, batch=2, seq=64, size="q", optimizer=name)
    for w in (2, 4)
    for name, mp in CHOICES
]


def step_rise(optimizer: torch.optim.Optimizer) -> int:
    """Run ``optimizer.step()`` under torch.profiler's memory timeline; the most bytes it allocated
    above what was live when it started (inductor's own buffers included)."""
    from torch.profiler import ProfilerActivity, profile

    # record_shapes and with_stack: without them torch 2.13 keeps no CPU allocation events
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        optimizer.step()
    now = rise = 0
    for _, action, _, size in p._memory_profile().timeline:
        name = str(action)
        if name.endswith("CREATE"):
            now += size
        elif name.endswith("DESTROY"):
            now -= size
        rise = max(rise, now)
    return rise


class _StepOutside:
    """The optimizer as `measure_step` sees it: its state, and a step run outside the counting mode
    (``step_peak``: live bytes at the step's start plus `step_rise`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, profiled: bool = True):
        self.optimizer = optimizer
        self.state = optimizer.state
        self.profiled = profiled
        self.step_peak = 0
        self.step_rise = 0

    def step(self) -> None:
        from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

        before = _get_current_dispatch_mode().update()
        with _disable_current_modes():
            self.step_rise = step_rise(self.optimizer) if self.profiled else self.optimizer.step()
        self.step_peak = before + (self.step_rise or 0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def measure_world(configs: list[dict]) -> list[dict]:
    import torch.distributed as dist
    from measure_step import measure_step
    from memory_planner_check import build, lm_loss

    import fsdp2kit as fk

    out = []
    for c in configs:
        torch.manual_seed(0)
        model = build(c["size"], meta=False)
        model.config.use_cache = False
        mesh = fk.make_mesh(shard=c["world"] // c["replicate"], replicate=c["replicate"])
        fk.shard_model(model, mesh, mixed_precision=c["mp"])
        opt = fk.make_optimizer(model, c["optimizer"], lr=1e-3)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(dist.get_rank())

        def make_batch(vocab=vocab, shape=(c["batch"], c["seq"] + 1), gen=gen):
            return torch.randint(0, vocab, shape, generator=gen)

        for _ in range(2):  # warm-up: the state exists, and torchao's step is compiled
            loss = lm_loss(model, make_batch())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
        # Once unprofiled: torchao's step compiles again under measure_step, and a profiled compile
        # (with_stack) held ~10 GB per rank (8-bit, world 2): world 4 was OOM-killed.
        measure_step(model, _StepOutside(opt, profiled=False), make_batch, lm_loss, list(model._fsdp2kit_blocks))
        outside = _StepOutside(opt)
        m = measure_step(model, outside, make_batch, lm_loss, list(model._fsdp2kit_blocks))
        row = m.__dict__ | {"step_peak": outside.step_peak, "step_rise": outside.step_rise}
        row["peak_all"] = max(m.peak, outside.step_peak)
        out.append(row)
        del model, opt, outside
    return out


def predict(c: dict):
    from memory_planner_check import build

    import fsdp2kit as fk

    return fk.plan_memory(
        build(c["size"], meta=True),
        shard=c["world"] // c["replicate"],
        replicate=c["replicate"],
        batch=c["batch"],
        seq=c["seq"],
        activation_checkpointing=c["ac"],
        mixed_precision=c["mp"],
        optimizer=c["optimizer"],
        device="cpu",
        prefetch=0,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def _err(p: int, m: int) -> str:
    return "exact" if p == m else f"{p / m - 1:+.2%}"


def markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "# Optimizer memory per rank: planner vs measurement (CPU, live tensor bytes)\n\n"
        "`benchmarks/optim_memory.py`: real gloo ranks train the `q` Llama of memory_planner_check.py "
        "(2 blocks x 256 wide, vocab 512: every block weight's local shard is quantized at world 2 and 4) with "
        "`fk.make_optimizer(model, NAME)`; one step after two warm-up steps is measured: forward and backward by "
        "`measure_step` (live storage bytes at every op), the optimizer step by torch.profiler's memory timeline "
        "(torchao's compiled step does not run under the counting dispatch mode). Predicted by "
        '`fsdp2kit.plan_memory(..., optimizer=NAME, device="cpu")`. MiB, the worst rank. '
        f"torch {meta['torch']}, {meta['seconds']} s, load average {tuple(round(x, 1) for x in meta['load'])} "
        "(2 shared cores).\n\n"
        "| world | optimizer | precision | peak predicted | peak measured | error | optimizer state predicted / "
        "measured | forward+backward peak predicted / measured | step peak predicted / measured |\n"
        "|---|---|---|---:|---:|---:|---|---|---|\n"
    )
    lines, worst_peak, worst_state, worst_fb = [], 0.0, 0.0, 0.0
    for r in rows:
        c, p, m = r["config"], r["predicted"], r["measured"]
        fb = max(p["forward_peak_bytes"], p["backward_peak_bytes"])
        err = p["peak_bytes"] / m["peak_all"] - 1
        worst_peak = max(worst_peak, abs(err))
        worst_state = max(worst_state, abs(p["parts"]["optimizer"] / m["optimizer"] - 1))
        worst_fb = max(worst_fb, abs(fb / m["peak"] - 1))
        lines.append(
            f"| {c['world']} | {c['optimizer']} | {c['mp']} | {_mib(p['peak_bytes'])} | {_mib(m['peak_all'])} | "
            f"{err:+.2%} | {_mib(p['parts']['optimizer'])} / {_mib(m['optimizer'])} "
            f"({_err(p['parts']['optimizer'], m['optimizer'])}) | {_mib(fb)} / {_mib(m['peak'])} ({_err(fb, m['peak'])}) "
            f"| {_mib(p['optimizer_peak_bytes'])} / {_mib(m['step_peak'])} "
            f"({_err(p['optimizer_peak_bytes'], m['step_peak'])}) |"
        )
    foot = (
        f"\n\n{len(rows)} configurations. Largest error: peak {worst_peak:.2%}, optimizer state {worst_state:.2%}, "
        f"forward+backward peak {worst_fb:.2%} (the planner's bar: 2%). The step peak is the live bytes when the "
        "step starts (parameters, gradients, state) plus the most the step allocates; the planner's step "
        "temporaries for torchao's optimizers are per class, as measured by `--step` (fsdp2kit/planner/parts.py).\n"
        "\nNot measured: optimizer-state offload (`[optim] offload`), which needs a CUDA device.\n"
    )
    if meta.get("kept"):
        foot += f"\nMeasured by an earlier run, predicted again by this planner (world, optimizer): {', '.join(meta['kept'])}.\n"
    foot += "".join(f"\nNot measured: {f}\n" for f in meta.get("failed", []))
    return head + "\n".join(lines) + foot


def step_per_element(out: str) -> None:
    """One process, plain tensors: each low-bit class's step on one weight, bytes allocated above its state
    per element, against the planner's `optimizer_bytes` temporaries."""
    import torch.nn as nn

    import fsdp2kit as fk
    from fsdp2kit.planner.parts import optimizer_bytes

    lines = [
        "| optimizer | weight | dtype | step allocates (B) | per element | planner (B) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for name in ("adamw8bit", "adamw4bit", "adamw_fp8", "adamw_bf16sr"):
        for shape, dtype in (((256, 256), torch.float32), ((1024, 512), torch.float32), ((512, 512), torch.bfloat16)):
            dtype = torch.bfloat16 if name == "adamw_bf16sr" else dtype
            m = nn.Module()
            m.w = nn.Parameter(torch.randn(shape, dtype=dtype))
            opt = fk.make_optimizer(m, name, lr=1e-3)
            for i in range(3):  # two steps compile and make the state; the third is measured
                m.w.grad = torch.randn_like(m.w)
                rise = step_rise(opt) if i == 2 else opt.step()
            planned = optimizer_bytes([(m.w.numel(), dtype, shape)], name).temporaries
            lines.append(
                f"| {name} | {shape[0]} x {shape[1]} | {str(dtype)[6:]} | {rise} | {rise / m.w.numel():.3f} | {planned} |"
            )
            print(lines[-1], flush=True)
    head = (
        "# torchao optimizers' step temporaries (CPU, one process)\n\n`benchmarks/optim_memory.py --step`: bytes "
        "the step allocates above its state (torch.profiler's memory timeline), after two compiling steps; "
        f"torch {torch.__version__}, inductor's CPU kernels.\n\n"
    )
    Path(out).write_text(head + "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/optim_memory")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--optimizers", default=",".join(n for n, _ in CHOICES))
    ap.add_argument("--step", action="store_true", help="only the per-class step temporaries (optim_step.md)")
    args = ap.parse_args()
    if args.step:
        return step_per_element(str(Path(args.out).parent / "optim_step.md"))
    from fsdp2kit.testing import WorldError, run_world

    worlds, names = [int(w) for w in args.worlds.split(",")], args.optimizers.split(",")
    chosen = [c for c in GRID if c["world"] in worlds and c["optimizer"] in names]
    rows, failed, t0 = [], [], time.time()
    old = Path(args.out + ".json")
    if old.exists():  # the other worlds' measurements stay, predicted again by this planner
        for r in json.loads(old.read_text())["rows"]:
            if r["config"] not in chosen:
                rows.append(r | {"predicted": predict(r["config"]).to_dict()})
    for world in worlds:
        for c in [c for c in chosen if c["world"] == world]:
            # One spawn per optimizer: four ranks compiling torchao's steps of several optimizers in one
            # process each ran out of this machine's memory (24 GB shared).
            try:
                ranks = run_world(measure_world, world, [c], timeout=1500)
            except WorldError as e:  # e.g. a rank killed for memory: say so, measure the rest
                failed.append(f"world {c['world']} {c['optimizer']}: {' '.join(str(e).split())[:300]}")
                print(f"not measured: {failed[-1]}", flush=True)
                continue
            measured = max((r[0] for r in ranks), key=lambda m: m["peak_all"])
            plan = predict(c)
            rows.append(dict(config=c, predicted=plan.to_dict(), measured=measured))
            rows.sort(key=lambda r: (r["config"]["world"], GRID.index(r["config"])))
            print(
                f"{c['world']} {c['optimizer']}: predicted {plan.peak_bytes} measured {measured['peak_all']} "
                f"({plan.peak_bytes / measured['peak_all'] - 1:+.2%}); state {plan.parts['optimizer']} vs "
                f"{measured['optimizer']}; step {plan.optimizer_peak} vs {measured['step_peak']}",
                flush=True,
            )
    meta = dict(load=os.getloadavg(), seconds=round(time.time() - t0, 1), torch=torch.__version__, failed=failed)
    meta["kept"] = [f"{r['config']['world']} {r['config']['optimizer']}" for r in rows if r["config"] not in chosen]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    Path(args.out + ".md").write_text(markdown(rows, meta))
    print(f"wrote {args.out}.json and .md in {meta['seconds']} s")


if __name__ == "__main__":
    main()
