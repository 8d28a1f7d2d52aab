"""The GPU benchmark of `make gpu-check`: speed, MFU and memory of a ~1B Llama on one GPU, and more.

On one GPU (world 1; under torchrun every rank reports its own memory), in this order, as long as
the time budget lasts (each case is skipped, and says so, when it would overrun):

1. training steps of a Llama-3.2-1B-shaped model (1.24 B parameters, tied embeddings), bf16
   compute over fp32 master weights, AdamW, at a few batch x sequence sizes: plain, selective
   activation checkpointing, per-block compile, float8 (eager, and compiled as torchao intends):
   tokens/s, MFU against the device's dense bf16 peak (`fsdp2kit.mfu`), per-rank
   ``max_memory_allocated`` / ``max_memory_reserved``, and the memory planner's prediction beside
   them when ``fsdp2kit.plan_memory`` exists;
2. `Checkpointer` save and load throughput from GPU memory, and the asynchronous save's stall;
3. `load_pretrained` of the same model from a local safetensors directory: time and GPU peak;
4. Llama-3-8B with fsdp2kit's CPU offload, when the host holds its fp32 state;
5. tokens/s of the 1B model (batch 1) with AdamW's state on the GPU, optimizer-state offload
   (``make_optimizer(offload=True)``) and CPU offload, interleaved (benchmarks/optim_offload_speed.py).

    python benchmarks/gpu_bench.py                  # on a GPU machine (make gpu-check runs it)
    python benchmarks/gpu_bench.py --dry-run        # CPU, tiny model, seconds: the code path only

Writes one JSON and one markdown file under benchmarks/results/ named after the device (the
dry run writes under a temporary directory unless --out-dir is given), rewritten after every case
so that a run cut short still leaves what it measured. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gpu_io import checkpoint_case, load_pretrained_case  # noqa: E402
from gpu_report import describe_machine, free_memory, memory_per_rank, reset_peak, rss_bytes, sync, write_results  # noqa: E402

import fsdp2kit as fk  # noqa: E402
from fsdp2kit.mfu import peak_flops, transformer_flops_per_token  # noqa: E402
from fsdp2kit.models import NAMED_CONFIGS  # noqa: E402

MODELS = {
    # Llama 3.2 1B's published shape (config.json numbers; no weights are fetched).
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-8b": NAMED_CONFIGS["llama3-8b"],
    # --dry-run: every Linear dimension a multiple of 16, so float8 runs too.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    ),
}
VARIANTS = {
    "plain": {},
    "AC selective": {"ac": "selective"},
    "compile": {"compile": True},
    "float8": {"float8": True},
    "float8+compile": {"float8": True, "compile": True},
}
# Rough seconds per case on an H100, to skip what would overrun the budget (compile pays inductor).
COST = {"eager": 25, "compile": 100, "checkpoint": 90, "load_pretrained": 60, "offload": 240, "optim_offload": 200}


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build(name: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**MODELS[name])
    config.use_cache = False  # training: no KV cache (and compile_blocks warns otherwise)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, config


def planner_prediction(name: str, batch: int, seq: int, ac: str | None, offload: bool, optim: str, device) -> dict:
    """The memory planner's per-rank peak for this case (float8 and compile are not modelled), or why not."""
    plan_memory = getattr(fk, "plan_memory", None)
    if plan_memory is None:
        return {"status": "planner not available"}
    model, _ = build(name)
    kwargs = dict(shard=dist.get_world_size(), batch=batch, seq=seq, activation_checkpointing=ac)
    kwargs["mixed_precision"] = "bf16"
    optional = {"cpu_offload": offload, "optimizer": optim, "device": device.type}
    accepted = inspect.signature(plan_memory).parameters
    kwargs.update({k: v for k, v in optional.items() if k in accepted})
    try:
        report = plan_memory(model, **kwargs)
    except Exception as e:  # a planner that cannot model this case says why, the benchmark goes on
        return {"status": f"planner failed: {type(e).__name__}: {str(e)[:300]}"}
    peak = report.get("peak_bytes") if isinstance(report, dict) else getattr(report, "peak_bytes", None)
    details = report.to_dict() if hasattr(report, "to_dict") else None
    if peak is None and details:
        peak = details.get("peak_bytes")
    status = "ok" if peak is not None else "no peak_bytes in the report"
    return {"status": status, "peak_bytes": peak, "kwargs": kwargs, "report": details}


def step_prediction(name: str, batch: int, seq: int, ac: str | None, offload: bool, device) -> dict:
    """The planner's step time for this case on the preset of this GPU (issue 26's check against a
    measurement; compile and float8 are not modelled), or why not."""
    from fsdp2kit.planner.api import Settings
    from fsdp2kit.planner.hardware import GPUS, load_hardware
    from fsdp2kit.planner.steptime import predict_step

    gpu = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
    preset = next((k for k in GPUS if k in gpu), None)
    if preset is None:
        return {"status": f"no planner preset for {gpu or device.type!r}"}
    model, _ = build(name)
    settings = Settings(
        shard=dist.get_world_size(),
        batch=batch,
        seq=seq,
        activation_checkpointing=ac,
        mixed_precision="bf16",
        cpu_offload=offload,
    )
    try:
        step = predict_step(model, settings, load_hardware(preset))
    except Exception as e:  # the benchmark goes on
        return {"status": f"prediction failed: {type(e).__name__}: {str(e)[:300]}"}
    return {"status": "ok", "preset": preset, **step.to_dict()}


def train_case(name: str, variant: str, batch: int, seq: int, args, info, *, offload=False, optim="adamw") -> dict:
    """Build, shard and train one configuration; time the steps after warm-up."""
    device, world = info.device, dist.get_world_size()
    opts = VARIANTS[variant]
    out = {"model": name, "variant": variant, "batch": batch, "seq": seq, "world": world, "cpu_offload": offload}
    out["optimizer"] = optim
    if opts.get("float8") and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return {**out, "status": "skipped: float8 needs compute capability 8.9 or newer"}
    out["planner"] = planner_prediction(name, batch, seq, opts.get("ac"), offload, optim, device)
    if not (opts.get("compile") or opts.get("float8")):
        out["step_prediction"] = step_prediction(name, batch, seq, opts.get("ac"), offload, device)
    model, config = build(name)
    if opts.get("float8"):
        fk.enable_float8(model)
    if opts.get("ac"):
        fk.apply_activation_checkpointing(model, mode=opts["ac"])
    if opts.get("compile"):
        # Each case compiles a new model: start from an empty dynamo cache, or the cases before would
        # count against the recompile limit and a later case could silently run in eager.
        torch._dynamo.reset()
        # The dry run checks the code path on CPU without paying for inductor's C++ build.
        fk.compile_blocks(model, **({"backend": "eager"} if args.dry_run else {}))
    fk.shard_model(model, fk.make_mesh(), mixed_precision="bf16", cpu_offload=offload)
    start = time.perf_counter()
    fk.materialize(model)
    sync(device)
    out["materialize_s"] = time.perf_counter() - start
    params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-5) if optim == "adamw" else torch.optim.SGD(params, lr=1e-5)
    out["params"] = sum(p.numel() for p in model.parameters())
    flops_per_token = transformer_flops_per_token(model, config.num_hidden_layers, config.hidden_size, seq)
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    free_memory()
    reset_peak(device)
    times, losses = [], []
    warmup = args.warmup + (1 if opts.get("compile") else 0)
    if offload:  # seconds per step: the optimizer runs on the CPU
        warmup, steps = 1, max(2, args.steps // 3)
    else:
        steps = args.steps
    for _ in range(warmup + steps):
        tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=gen)
        sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = sorted(times[warmup:])
    step_s = timed[len(timed) // 2]
    tokens_per_s = batch * seq * world / step_s
    peak = peak_flops(device)
    out.update(
        status="ok",
        first_step_s=times[0],
        step_s=step_s,
        step_s_min=timed[0],
        step_s_max=timed[-1],
        tokens_per_s=tokens_per_s,
        flops_per_token=flops_per_token,
        tflops_per_gpu=flops_per_token * tokens_per_s / world / 1e12,
        mfu=flops_per_token * tokens_per_s / world / peak if peak else None,
        memory=memory_per_rank(device),
        host_rss_bytes=rss_bytes(),  # this process's resident memory now (offload: the sharded state is here)
        loss_first=losses[0],
        loss_last=losses[-1],
        loss_finite=all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
    )
    return out


def offload_fit(name: str) -> tuple[str | None, str]:
    """The optimizer whose fp32 state fits in host memory beside the offloaded parameters, or None."""
    model, _ = build(name)
    n = sum(p.numel() for p in model.parameters())
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    for optim, per_param in (("adamw", 16), ("sgd", 8)):  # params + grads (+ two moments), fp32
        if n * per_param < 0.8 * avail:
            return optim, f"{n / 1e9:.2f} B parameters x {per_param} bytes fit in {avail / 2**30:.0f} GiB available"
    return None, f"{n / 1e9:.2f} B parameters need {n * 8 / 2**30:.0f} GiB or more; {avail / 2**30:.0f} GiB available"


def plan(args) -> list[tuple[str, tuple, int]]:
    """(kind, arguments, cost key) in priority order."""
    if args.dry_run:
        shapes, model = [(2, 32)], "tiny"
    else:
        shapes, model = args.shapes, args.model
    first, *rest = shapes
    variants = [v for v in VARIANTS if v.lower().replace(" ", "_") in args.variants]
    items = [("train", (model, v, *first), "compile" if "compile" in v else "eager") for v in variants]
    items += [("checkpoint", (model,), "checkpoint"), ("load_pretrained", (model,), "load_pretrained")]
    for shape in rest:
        items += [("train", (model, v, *shape), "compile" if "compile" in v else "eager") for v in variants]
    if not args.no_offload:
        big, shape = ("tiny", (1, 32)) if args.dry_run else (args.offload_model, args.offload_shape)
        items.append(("offload", (big, "AC selective", *shape), "offload"))
        items.append(("optim_offload", (model, 1, first[1]), "optim_offload"))
    return [item for item in items if item[0] in args.cases]


def optim_offload_case(name: str, batch: int, seq: int, args, info) -> dict:
    """The three places of AdamW's state side by side (optim_offload_speed.py), the model's three copies at once."""
    from optim_offload_speed import measure

    rounds, steps = (2, 1) if args.dry_run else (3, 2)
    variants = measure(
        lambda: build(name)[0],
        batch=batch,
        seq=seq,
        vocab=MODELS[name]["vocab_size"],
        rounds=rounds,
        steps=steps,
        mp="bf16",
        device=info.device,
    )
    return dict(model=name, batch=batch, seq=seq, status="ok", rounds=rounds, steps=steps, variants=variants)


def _write(result: dict, out_dir: Path) -> tuple[Path, Path]:
    """`write_results`, with the optimizer-state offload table appended to the markdown."""
    paths = write_results(result, out_dir)
    rec = result.get("optim_offload")
    if rec:
        from optim_offload_speed import markdown

        what = f"{rec['model']}, bf16 compute, batch {rec.get('batch')} x seq {rec.get('seq')}"
        if rec["status"] != "ok":
            text = f"\n## AdamW state: device vs state offload vs CPU offload\n\n{what}: {rec['status']}\n"
        else:
            meta = dict(
                what=what, rounds=rec["rounds"], steps=rec["steps"], machine=result["device"], torch=result["torch"]
            )
            meta.update(world=result["world"], load=result["loadavg_now"])
            text = "\n#" + markdown(rec["variants"], meta)
        with open(paths[1], "a") as f:
            f.write(text)
    return paths


def _what(kind: str, case_args: tuple) -> dict:
    if kind in ("train", "offload"):
        return dict(zip(("model", "variant", "batch", "seq"), case_args), cpu_offload=kind == "offload")
    if kind == "optim_offload":
        return dict(zip(("model", "batch", "seq"), case_args))
    return {"model": case_args[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a few seconds: exercises the code path")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip cases that would end after this many seconds")
    p.add_argument("--end-by", type=float, help="instead of --budget-s: end by this time (seconds since the epoch)")
    p.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    p.add_argument(
        "--shapes", default="4x2048,1x8192,8x2048", help="batch x seq, comma-separated; the first is measured first"
    )
    p.add_argument(
        "--variants",
        default=",".join(v.lower().replace(" ", "_") for v in VARIANTS),
        help="training variants, comma-separated (default: all)",
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--offload-model", default="llama-8b", choices=sorted(MODELS))
    p.add_argument("--offload-shape", default="1x2048")
    p.add_argument("--no-offload", action="store_true")
    p.add_argument(
        "--cases", default="train,checkpoint,load_pretrained,offload,optim_offload", help="kinds of case to run"
    )
    p.add_argument("--tag", default="", help="added to the result files' names (e.g. a second run on the same day)")
    p.add_argument("--tests-junit", help="JUnit XML of the cuda tests, summarised in the result")
    p.add_argument("--workdir", help="where checkpoints and the HF export go (default: a temporary directory)")
    p.add_argument("--out-dir", help="default: benchmarks/results (a temporary directory for --dry-run)")
    args = p.parse_args(argv)
    args.shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    args.cases = set(args.cases.split(","))
    args.variants = set(args.variants.split(","))
    args.offload_shape = tuple(int(x) for x in args.offload_shape.split("x"))
    if args.dry_run:
        args.steps, args.warmup = 2, 1
    t_start = time.monotonic()
    if args.end_by:  # an absolute deadline (gpu_check.sh): python's start-up counts against it too
        args.budget_s = args.end_by - time.time()

    info = fk.init_distributed(device="cpu" if args.dry_run else None)
    if info.device.type != "cuda" and not args.dry_run:
        print(
            "gpu_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run on CPU", file=sys.stderr
        )
        return 2
    out_dir = Path(args.out_dir) if args.out_dir else (Path(tempfile.mkdtemp()) if args.dry_run else HERE / "results")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "gpu_bench", "dry_run": args.dry_run, "budget_s": args.budget_s, "tag": args.tag}
    result.update(describe_machine(info), argv=sys.argv[1:])
    result.update(planner="fsdp2kit.plan_memory" if hasattr(fk, "plan_memory") else "planner not available")
    result.update(train=[], checkpoint=None, load_pretrained=None, offload=None, optim_offload=None, skipped=[])
    result["tests_junit"] = args.tests_junit
    paths = _write(result, out_dir)
    cost_of = dict(COST)  # raised to what a case of each kind really took here
    for kind, case_args, cost_key in plan(args):
        elapsed, cost = time.monotonic() - t_start, cost_of[cost_key]
        label = f"{kind} {case_args}"
        if not args.dry_run and elapsed + cost > args.budget_s:
            result["skipped"].append(
                f"{label}: time budget ({elapsed:.0f} s used of {args.budget_s:.0f}, ~{cost:.0f} s needed)"
            )
            log(f"skip {label}: time budget")
            continue
        log(f"run {label}")
        try:
            if kind == "train":
                rec = train_case(*case_args, args, info)
            elif kind == "offload":
                optim, why = offload_fit(case_args[0])
                rec = {"model": case_args[0], "status": f"skipped: {why}", "cpu_offload": True}
                if optim is not None:
                    rec = {**train_case(*case_args, args, info, offload=True, optim=optim), "host_fit": why}
            elif kind == "optim_offload":
                rec = optim_offload_case(*case_args, args, info)
            elif kind == "checkpoint":
                rec = checkpoint_case(build, *case_args, info, workdir)
            else:
                rec = load_pretrained_case(build, *case_args, info, workdir)
        except torch.OutOfMemoryError as e:
            rec = {**_what(kind, case_args), "status": f"out of memory: {str(e).splitlines()[0][:200]}"}
        except Exception as e:  # one broken case must not cost the others their figures
            rec = {**_what(kind, case_args), "status": f"error: {type(e).__name__}: {str(e)[:500]}"}
        rec["case_s"] = time.monotonic() - t_start - elapsed
        cost_of[cost_key] = max(cost_of[cost_key], rec["case_s"])
        log(f"done {label}: {rec.get('status')} ({rec['case_s']:.0f} s)")
        if kind == "train":
            result["train"].append(rec)
        else:
            result[kind] = rec
        free_memory()
        result["elapsed_s"] = time.monotonic() - t_start
        paths = _write(result, out_dir)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    log(f"wrote {paths[0]} and {paths[1]}")
    print(paths[1].read_text())
    bad = [
        r
        for r in [*result["train"], result["checkpoint"], result["load_pretrained"]]
        if r and r["status"].startswith("error")
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
