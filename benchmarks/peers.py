"""fsdp2kit against the other FSDP2 stacks (transformers' native FSDP2, Accelerate's) on one checkpoint, in one run.

    PYTHONPATH=. python benchmarks/peers.py       # `make bench-peers`: the committed CPU table (2 gloo ranks)
    PYTHONPATH=. python benchmarks/peers.py --config demo --repeats 1 --steps 2 --out /tmp/p   # a quick try

It starts its own worlds of processes (`fsdp2kit.testing.run_world`), so no torchrun. This process
builds a Llama from a named config (default ``bench-512x8``, 33.7M parameters), seeds it
and saves it with ``save_pretrained`` into a temporary directory in fp32. Why fp32: it is what
every library's default then trains in. transformers' ``from_pretrained`` defaults to
``dtype="auto"`` (the checkpoint's dtype), so a bf16 file would make it train pure bf16 (no fp32
master weights) while fsdp2kit upcasts to fp32 masters: the losses would not be comparable and
the speeds would measure two different numerics. With an fp32 file, all libraries hold the
same fp32 weights, bit for bit, before the first step.

Each library, at the defaults its documentation shows, goes "from nothing" (the process group
exists; no model, no mesh) to a sharded model and an AdamW optimizer ready to train:

- ``fsdp2kit``: ``make_mesh``; the model built on the meta device from the directory's config
  (``fsdp2kit.models.build_causal_lm``, as recipes/train.py does); ``shard_model``;
  ``load_pretrained`` (README, "Weights").
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir,
  distributed_config=DistributedConfig(fsdp_size=world))``, which builds its own mesh, applies
  fully_shard per its model's FSDP plan, then loads the weights into the shards.
- ``accelerate``: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``,
  ``from_pretrained(dir)``, ``accelerator.prepare(model, optimizer)``. On CPU Accelerate does
  not shard: the attempt, the documented CPU switch (``Accelerator(cpu=True, ...)``) and
  ``accelerate launch --cpu --use_fsdp`` are each tried and what happened is recorded verbatim
  in the results; a library that does not shard takes no part in the measurements.

Method: every load runs in a fresh world of processes (nothing left from an earlier load, so
the resident-set figures belong to that library alone), libraries interleaved, the order rotated
every round; lazily imported modules are imported before the clock starts. A load is timed from
a barrier to the slowest rank's end. Then every byte of the rank's shards is read once: a
library may leave its shards memory-mapped from the checkpoint (transformers does; fsdp2kit copies
into its shards), and then its load has read nothing yet; "load + read" is the time until the weights are really in memory.
Because a lazy load moves its reading into the first use, every round also runs each library's
load once more in another fresh world and then times its first training step (forward, backward,
AdamW step: every shard byte is read and, for a mapped shard, copied on write there): "load +
first step" is a cost both libraries pay before their second step, whatever they defer.
Memory is the rise of the resident set's high-water mark (VmHWM, benchmarks/common.py) over the
resident set before the load, per rank: at the end of the load, after the read, and (first round)
during a training step after the warm-up steps. Training runs every measured library in one
world on the same batches (different per rank, identical across libraries), one step of each
library per round, the order rotated; after warm-up steps the median step time (slowest rank)
gives tokens/s. Every step's loss on every rank is compared with fsdp2kit's (largest relative
difference).
Results: benchmarks/results/<name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import machine, reset_rss_peak, rss, rss_peak
from torch.distributed.tensor import DTensor

import fsdp2kit as fk
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit.models import build_causal_lm, llama_config

HERE = Path(__file__).resolve().parent
MB = 1e6
LIBRARIES = ("fsdp2kit", "transformers", "accelerate")


class Refused(RuntimeError):
    """A library ran but did not shard the model (or would not run): it is reported, not measured."""


def _sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def load_fsdp2kit(path: str, lr: float):
    mesh = fk.make_mesh()
    model = build_causal_lm(path, meta=True)
    fk.shard_model(model, mesh)
    fk.load_pretrained(model, path)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def load_transformers(path: str, lr: float):
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size())
    )
    if not _sharded(model):
        raise Refused("from_pretrained(distributed_config=...) returned a model with no sharded parameter")
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _accelerate_try(path: str, lr: float, **accelerator_kwargs):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    AcceleratorState._reset_state(reset_partial_state=True)  # each attempt starts from Accelerate's defaults
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), **accelerator_kwargs)
    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = (
        f"Accelerator({', '.join(f'{k}={v!r}' for k, v in accelerator_kwargs.items())}"
        f"{', ' if accelerator_kwargs else ''}fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)): "
        f"distributed_type={accelerator.distributed_type}, device={accelerator.device}, "
        f"num_processes={accelerator.num_processes}; prepare returned {type(model).__name__} "
        f"with {'sharded (DTensor)' if _sharded(model) else 'whole (not sharded)'} parameters"
    )
    return model, optimizer, state


def load_accelerate(path: str, lr: float, attempts: list | None = None):
    """Accelerate's FSDP2 as documented; on CPU, then its documented CPU switch. Refused if neither shards."""
    tried = []
    for kwargs in ({}, {"cpu": True}):
        try:
            model, optimizer, state = _accelerate_try(path, lr, **kwargs)
        except Exception as e:  # the refusal, verbatim
            tried.append(f"Accelerator({kwargs}): {type(e).__name__}: {e}")
            continue
        tried.append(state)
        if _sharded(model):
            if attempts is not None:
                attempts.extend(tried)
            return model, optimizer
        del model, optimizer
    if attempts is not None:
        attempts.extend(tried)
    raise Refused("; ".join(tried))


LOADERS = {"fsdp2kit": load_fsdp2kit, "transformers": load_transformers, "accelerate": load_accelerate}


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _import_everything() -> None:
    """What a library imports lazily on first use is imported before anything is timed."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.distributed.configuration_utils import DistributedConfig  # noqa: F401

    with __import__("contextlib").suppress(ImportError):
        import accelerate  # noqa: F401


def _touch(model) -> None:
    """Read every byte of this rank's shards once: a lazily loaded (memory-mapped) shard is read here."""
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).sum()


def load_world(lib: str, path: str, opts: dict) -> dict:
    """One library's load, in a fresh world: its time, its memory, and optionally a step's peak.

    Returns this rank's figures: ``seconds`` (slowest rank, from a barrier to a sharded model
    and its optimizer), ``cpu_seconds`` (the busier rank's process CPU time in that span, all
    threads: on a shared machine it moves less than wall time), ``touch_seconds`` (then reading every shard byte once), the VmHWM rise over
    the resident set before the load at the end of the load (``load_peak``) and after the touch
    (``touched_peak``); with ``opts["memory_steps"]``, the peak during a training step after
    that many steps (``step_peak``), over the same baseline. Or ``refused``.
    """
    _import_everything()
    base = reset_rss_peak() or rss()
    attempts: list = []
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        if lib == "accelerate":
            model, optimizer = load_accelerate(path, opts["lr"], attempts)
        else:
            model, optimizer = LOADERS[lib](path, opts["lr"])
        error = None
    except Refused as e:
        error = str(e)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    load_peak = rss_peak() - base
    if _max_over_ranks(1.0 if error else 0.0) > 0:  # the same verdict on every rank
        return {"refused": error or "refused on another rank", "attempts": attempts}
    seconds, cpu_seconds = _max_over_ranks(seconds), _max_over_ranks(cpu_seconds)
    if opts.get("then") == "step":  # load + the first training step: what both libraries pay before step 2
        model.train()
        batch = make_batches(1, opts["batch"], opts["seq"], opts["vocab"])[0]
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, optimizer, batch)
        return {
            "seconds": seconds,
            "first_step_seconds": _max_over_ranks(time.perf_counter() - t0),
            "first_step_peak": rss_peak() - base,
            "attempts": attempts,
        }
    t0 = time.perf_counter()
    _touch(model)
    touch_seconds = _max_over_ranks(time.perf_counter() - t0)
    out = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "touch_seconds": touch_seconds,
        "load_peak": load_peak,
        "touched_peak": rss_peak() - base,
        "state_bytes": 0,
        "attempts": attempts,
    }
    if opts["memory_steps"]:
        model.train()
        batches = make_batches(opts["memory_steps"] + 1, opts["batch"], opts["seq"], opts["vocab"])
        for tokens in batches[:-1]:
            train_step(model, optimizer, tokens)
        reset_rss_peak()
        train_step(model, optimizer, batches[-1])
        out["step_peak"] = rss_peak() - base
        out["state_bytes"] = state_bytes(model, optimizer)
    return out


def train_world(libs: list[str], path: str, opts: dict) -> dict:
    """Every library's model, trained side by side on the same batches: step times and losses."""
    _import_everything()
    models = {lib: LOADERS[lib](path, opts["lr"]) for lib in libs}
    for model, _ in models.values():
        model.train()
    n = opts["warmup"] + opts["steps"]
    batches = make_batches(n, opts["batch"], opts["seq"], opts["vocab"])
    losses = {lib: [] for lib in libs}
    times = {lib: [] for lib in libs}
    for s in range(n):
        for lib in libs[s % len(libs) :] + libs[: s % len(libs)]:  # the order rotates every round
            dist.barrier()
            t0 = time.perf_counter()
            losses[lib].append(train_step(*models[lib], batches[s]))
            dt = _max_over_ranks(time.perf_counter() - t0)
            if s >= opts["warmup"]:
                times[lib].append(dt)
    return {"losses": losses, "times": times, "loadavg": os.getloadavg()}


def make_batches(n: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + dist.get_rank())  # a different batch on every rank
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def train_step(model, optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def state_bytes(model, optimizer) -> int:
    """Parameters and optimizer state held by this rank (local shards), in bytes."""

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    n = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for st in optimizer.state.values():
        n += sum(local(v).numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return n


def accelerate_launch_check() -> str:
    """What `accelerate launch` says to a CPU FSDP launch (its documented launcher; `--cpu` is its CPU switch)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "noop.py"  # what would run, were the launch accepted
        script.write_text("pass\n")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--use_fsdp", "--fsdp_version", "2"]
        cmd += ["--num_processes", "2", str(script)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"could not run: {e}"
    lines = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()]
    return f"`accelerate launch --cpu --use_fsdp --fsdp_version 2 --num_processes 2 ...` exit {proc.returncode}: " + (
        lines[-1] if lines else "(no output)"
    )


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from fsdp2kit.testing import run_world

    world = args.nproc
    config = llama_config(args.config)
    opts = {
        "lr": args.lr, "batch": args.batch, "seq": args.seq, "vocab": config.vocab_size,
        "warmup": args.warmup, "steps": args.steps, "memory_steps": 0,
    }  # fmt: skip
    result = {
        "machine": machine(world_size=world),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": args.config,
        "checkpoint_dtype": args.dtype,
        "loadavg": {"start": os.getloadavg()},
        "refused": {},
        "accelerate_attempts": [],
    }
    libs = [lib for lib in LIBRARIES if lib in args.libraries]
    with tempfile.TemporaryDirectory(prefix="peers-") as path:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        result["parameters"] = sum(p.numel() for p in model.parameters())
        model.to(getattr(torch, args.dtype)).save_pretrained(path)
        del model

        # 1. loads, each in a fresh world, interleaved; the first round also measures a step's peak
        loads: dict[str, list] = {lib: [] for lib in libs}
        stepped: dict[str, list] = {lib: [] for lib in libs}
        for r in range(args.repeats):
            for lib in [x for x in libs[r % len(libs) :] + libs[: r % len(libs)] if x in libs]:
                ranks = run_world(load_world, world, lib, path, {**opts, "memory_steps": args.warmup if r == 0 else 0})
                if lib == "accelerate" and r == 0:
                    result["accelerate_attempts"] = ranks[0]["attempts"]
                if "refused" in ranks[0]:
                    result["refused"][lib] = ranks[0]["refused"]
                    libs.remove(lib)
                    continue
                loads[lib].append(ranks)
                # the same load again in a fresh world, then the first training step, timed
                stepped[lib].append(run_world(load_world, world, lib, path, {**opts, "then": "step"}))
            print(f"load round {r}: " + ", ".join(f"{k} {v[-1][0]['seconds']:.2f}s" for k, v in loads.items() if v))
        result["loadavg"]["after_loads"] = os.getloadavg()

        # 2. training: every measured library in one world, steps interleaved
        trained = run_world(train_world, world, libs, path, opts, timeout=3600)
        result["loadavg"]["end"] = os.getloadavg()
    if "accelerate" in args.libraries and args.launch_check:
        result["accelerate_attempts"].append(accelerate_launch_check())

    tokens = world * args.batch * args.seq
    result["libraries"] = {}
    for lib in libs:
        rounds = loads[lib]  # rounds x ranks

        def per_rank(key, rounds=rounds):
            return [statistics.median(rd[k][key] for rd in rounds) / MB for k in range(world)]

        times = trained[0]["times"][lib]
        result["libraries"][lib] = {
            "load_seconds": [rd[0]["seconds"] for rd in rounds],
            "load_seconds_median": statistics.median(rd[0]["seconds"] for rd in rounds),
            "load_cpu_seconds_median": statistics.median(rd[0]["cpu_seconds"] for rd in rounds),
            "load_touch_seconds_median": statistics.median(rd[0]["seconds"] + rd[0]["touch_seconds"] for rd in rounds),
            "load_step_seconds": [rd[0]["seconds"] + rd[0]["first_step_seconds"] for rd in stepped[lib]],
            "load_step_seconds_median": statistics.median(
                rd[0]["seconds"] + rd[0]["first_step_seconds"] for rd in stepped[lib]
            ),
            "first_step_seconds_median": statistics.median(rd[0]["first_step_seconds"] for rd in stepped[lib]),
            "first_step_peak_mb_per_rank": per_rank("first_step_peak", stepped[lib]),
            "load_peak_mb_per_rank": per_rank("load_peak"),
            "touched_peak_mb_per_rank": per_rank("touched_peak"),
            "step_peak_mb_per_rank": [x["step_peak"] / MB for x in rounds[0]],
            "state_mb_per_rank": [x["state_bytes"] / MB for x in rounds[0]],
            "step_seconds": times,
            "step_seconds_median": statistics.median(times),
            "tokens_per_s": tokens / statistics.median(times),
            "losses_per_rank": [t["losses"][lib] for t in trained],
        }
    result["agreement"] = loss_agreement(result["libraries"])
    return result


def loss_agreement(libs: dict) -> dict:
    """Per other library: the largest relative loss difference from fsdp2kit's at each step, over ranks."""
    if "fsdp2kit" not in libs:
        return {}
    ref = libs["fsdp2kit"]["losses_per_rank"]
    out = {}
    for lib, res in libs.items():
        if lib == "fsdp2kit":
            continue
        per_step = [
            max(abs(a[s] - b[s]) / abs(b[s]) for a, b in zip(res["losses_per_rank"], ref, strict=True))
            for s in range(len(ref[0]))
        ]
        out[lib] = {"per_step": per_step, "max": max(per_step)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="bench-512x8", help="a fsdp2kit.models.NAMED_CONFIGS name")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="checkpoint dtype")
    parser.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (gloo, CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="load rounds, each library in a fresh world")
    parser.add_argument("--warmup", type=int, default=2, help="training steps not timed (and before the memory step)")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per library")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--name", default="peers", help="result file stem")
    parser.add_argument("--no-launch-check", dest="launch_check", action="store_false")
    parser.add_argument("--check-loss", type=float, help="exit 1 if a library's loss differs more than this")
    args = parser.parse_args()
    from peers_report import write_report

    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(result, args.out / args.name)
    bad = {k: v["max"] for k, v in result["agreement"].items() if args.check_loss and v["max"] > args.check_loss}
    if bad:
        sys.exit(f"loss agreement failed: {bad} > {args.check_loss}")


if __name__ == "__main__":
    with quiet_imports():  # torchao's import-time lines on a CPU build: this script owns the process
        main()
