"""`fsdp2kit plan`: what each rank would hold for a model on a mesh, and whether a step fits, without a GPU."""

from __future__ import annotations

import json
import re

from fsdp2kit._internal.fmt import fmt_bytes
from fsdp2kit.models import build_causal_lm
from fsdp2kit.planner.api import Settings, plan_settings, plan_shards
from fsdp2kit.planner.hardware import load_hardware
from fsdp2kit.planner.search import cheapest_changes, pick_accumulation, rank_by_step_time
from fsdp2kit.planner.steptime import DEFAULT_PRICE, default_nodes, predict_step

_UNITS = {"": 2**30, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNITS.update(kb=10**3, mb=10**6, gb=10**9, tb=10**12)


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"`` (10^9), ``"80"`` (GiB), ``"512MiB"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r}: expected a size such as 80GiB, 96GB or 24 (GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_ac(text: str | None) -> str | int | None:
    if text is None or text.lower() == "none":
        return None
    return int(text) if text.isdigit() else text.lower()


def parse_targets(text: str | None) -> str | tuple[str, ...]:
    """``--lora-targets``: ``all-linear`` or comma-separated module names (as the recipe's ``[lora] targets``)."""
    names = tuple(t.strip() for t in ("all-linear" if text is None else text).split(",") if t.strip())
    if not names:
        raise ValueError("--lora-targets is empty: name the Linear modules to adapt, or all-linear")
    return "all-linear" if names == ("all-linear",) else names


def add_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="what each rank would hold for a model on a mesh, and whether a step fits, without a GPU",
        description="Build MODEL (a named config such as llama3-8b, or a local Hugging Face directory) on the "
        "meta device, with LoRA adapters if asked. Without --batch/--seq: print the ShardPlan shard_model would "
        "produce on a (replicate x shard x cp x tp) mesh. With them: predict the per-rank peak memory of a training "
        "step (fsdp2kit.plan_memory), and with --gpu-memory whether it fits and, if not, the cheapest changes "
        "that do; with --gpu also the predicted step time, tokens/s per GPU, MFU and cost (docs/step_time.md). "
        "A flag that means nothing in its combination is refused, never ignored.",
    )
    # Flags that describe a training step: without --batch/--seq (the ShardPlan alone) they are refused.
    step = p.add_argument_group("a training step's memory plan and time (with --batch and --seq)")
    p.add_argument("model", help="a named config (see fsdp2kit.models.NAMED_CONFIGS) or a local HF directory")
    p.add_argument("--shard", type=int, required=True, help="ranks that shard the model (e.g. GPUs per node)")
    p.add_argument("--replicate", type=int, default=1, help="replica groups (HSDP when > 1)")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (the model's own TP plan; the memory plan traces one TP rank)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks a sequence is split over (the recipe's [parallel] cp; the style: --cp-style): "
        "FSDP shards over shard x cp ranks; each rank holds seq/cp tokens (GPUs: replicate x shard x cp x tp)",
    )
    p.add_argument(
        "--cp-style",
        choices=("all_to_all", "ring"),
        help="with --cp: fsdp2kit.apply_context_parallel's style (the recipe's [parallel] cp_style): all_to_all "
        "(Ulysses, the default) or ring (CUDA; torch's ring attention: no packed rows, seq a multiple of 64 x cp)",
    )
    step.add_argument(
        "--packed",
        action="store_true",
        help="with --cp: rows hold several documents (the recipe's [data] packing, its default): the attention "
        "gets a seq x seq document mask a row in the compute dtype",
    )
    p.add_argument("--strategy", help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2")
    p.add_argument(
        "--mixed-precision",
        help="bf16 or fp16 (fp32 master weights whatever the checkpoint's dtype), pure_bf16 (bf16 weights, "
        "gradients and optimizer state) or fp32; default: the parameters as the checkpoint's config builds them",
    )
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--lora", type=int, metavar="R", help="train rank-R LoRA adapters (peft)")
    p.add_argument("--qlora", action="store_true", help="with --lora: NF4 base weights in the blocks (QLoRA)")
    step.add_argument(
        "--replicate-adapters",
        action="store_true",
        help="with --lora: adapters whole on every rank, all-reduced once a step; the base sharded "
        "(shard_model(..., replicate_adapters=True), the recipe's [lora] replicate_adapters)",
    )
    p.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="with --lora: comma-separated Linear module names to adapt, as the recipe's [lora] targets "
        "(default: all-linear, every Linear but the head)",
    )
    p.add_argument("--batch", type=int, help="micro-batch per data-parallel rank (sequences)")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    step.add_argument(
        "--ac",
        help="activation checkpointing: none, full, selective, op (torchtitan's per-op policy: attention and every "
        "other matmul saved) or N (every N-th)",
    )
    step.add_argument(
        "--optimizer",
        help="adamw (default), adamw8bit, adamw4bit, adamw_fp8, adamw_bf16sr (make_optimizer's names) or sgd",
    )
    step.add_argument(
        "--optimizer-offload",
        action="store_true",
        help="optimizer state and its step in host memory, parameters and gradients on the device "
        "(the recipe's [optim] offload; --cpu-offload moves the parameters too)",
    )
    step.add_argument("--grad-accum", type=int, metavar="M", help="micro-batches a step (gradient accumulation)")
    step.add_argument(
        "--accumulation",
        metavar="POLICY",
        help="with --grad-accum: how the micro-batches communicate (fsdp2kit.accumulate: regather, keep_gathered, "
        "defer_all_reduce, no_sync, ...); the peak adds what it holds between them. Default: the policy with the "
        "fewest bytes a step whose peak fits the memory budget; without a budget, the lowest peak "
        "(docs/accumulation.md)",
    )
    step.add_argument("--prefetch", type=int, help="explicit prefetch depth (default 1); 0: implicit")
    step.add_argument("--device", help="cuda (default: allocator margin, foreach AdamW) or cpu")
    step.add_argument("--gpu-memory", help="memory per device, e.g. 80GiB: says whether it fits")
    step.add_argument(
        "--gpu",
        metavar="NAME|FILE.toml",
        help="a GPU preset (a100, h100, h200, b200) or a TOML file of its fields: gives --gpu-memory (unless "
        "given) and predicts the step time, tokens/s per GPU, MFU and cost (docs/step_time.md)",
    )
    step.add_argument("--nodes", type=int, help="with --gpu: nodes the GPUs are spread over (default: the fewest)")
    step.add_argument(
        "--price-per-gpu-hour",
        type=float,
        metavar="USD",
        help="with --gpu: the price of one GPU-hour for the cost per billion tokens (default 2.50, illustrative)",
    )
    step.add_argument(
        "--gpu-set",
        action="append",
        metavar="FIELD=VALUE",
        help="with --gpu: override one field of the preset, e.g. network_bytes_per_s=1e11 or efficiency=0.4 "
        "(repeatable; fields in fsdp2kit.planner.hardware.Hardware)",
    )
    step.add_argument("--json", action="store_true", help="the memory plan as JSON (peak per rank in peak_bytes)")
    p.set_defaults(func=run_plan, step_flags=step._group_actions)


def run_plan(args) -> int:
    targets = parse_targets(args.lora_targets)
    if args.cp_style is not None and args.cp == 1:
        raise ValueError("--cp-style chooses how context parallelism attends: give --cp C (C > 1) too")
    memory = args.batch is not None or args.seq is not None
    if memory and (args.batch is None or args.seq is None):
        raise ValueError("a memory plan needs both --batch and --seq")
    # What the ShardPlan and the memory plan both take, under the same names.
    shared = {k: getattr(args, k) for k in ("shard", "replicate", "tp", "cp", "strategy", "mixed_precision", "lora")}
    shared.update(cpu_offload=args.cpu_offload, qlora=args.qlora, cp_style=args.cp_style or "all_to_all")
    shared["lora_targets"] = targets
    if not memory:
        given = [a.option_strings[0] for a in args.step_flags if getattr(args, a.dest) != a.default]
        if given:
            raise ValueError(f"{', '.join(given)}: only a training step's memory plan uses it; give --batch and --seq")
        print(plan_shards(build_causal_lm(args.model, meta=True), **shared))  # as the recipe's --train.plan_only
        return 0

    hardware = parse_gpu(args.gpu, args.gpu_set)
    for flag in ("nodes", "price_per_gpu_hour"):
        if getattr(args, flag) is not None and hardware is None:
            raise ValueError(f"--{flag.replace('_', '-')} predicts step time: give --gpu too")
    gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory else getattr(hardware, "memory_bytes", None)
    # Step flags left out take Settings' defaults.
    given = {k: getattr(args, k) for k in ("optimizer", "prefetch", "device", "grad_accum", "accumulation")}
    settings = Settings(
        **shared,
        **{k: v for k, v in given.items() if v is not None},
        batch=args.batch,
        seq=args.seq,
        packed=args.packed,
        activation_checkpointing=parse_ac(args.ac),
        optimizer_offload=args.optimizer_offload,
        replicate_adapters=args.replicate_adapters,
    )
    if args.packed and settings.cp == 1:
        raise ValueError("--packed adds the document mask of context parallelism: give --cp C (C > 1) too")
    if args.accumulation is not None and settings.grad_accum == 1:
        raise ValueError("--accumulation chooses how micro-batches communicate: give --grad-accum M (M > 1) too")
    settings.check()  # bad options fail before the model is built
    # The model's own position limit (a named config's published one): a longer --seq is noted, not hidden.
    model = build_causal_lm(args.model, meta=True)
    policies, cache = None, {}
    if settings.grad_accum > 1:
        picked, _, policies = pick_accumulation(model, settings, gpu_memory, cache)
        settings = picked if args.accumulation is None else settings
    plan = plan_settings(model, settings, cache)  # with --grad-accum, the step recorded for the policies
    plan.config["model"] = args.model
    plan.gpu_memory = gpu_memory
    step = None
    if hardware is not None:
        nodes = args.nodes if args.nodes is not None else default_nodes(settings, hardware)
        price = DEFAULT_PRICE if args.price_per_gpu_hour is None else args.price_per_gpu_hour
        step = predict_step(model, settings, hardware, nodes=nodes, price_per_gpu_hour=price, memory_plan=plan)
    if gpu_memory is not None and not plan.fits:
        # With --gpu every change that fits is timed, and the fastest shown (the search's own limit is 6).
        plan.changes = cheapest_changes(model, settings, gpu_memory, limit=6 if step is None else 50)
        if step is not None:
            ranked = rank_by_step_time(model, settings, plan.changes, hardware, nodes=step.nodes, baseline=step)
            plan.changes = ranked[:6]
    if args.json:
        out = plan.to_dict()
        if policies is not None:
            out["accumulation_policies"] = policies
        if step is not None:
            out.update(step.to_dict())
        print(json.dumps(out, indent=1))
    else:
        print(plan)
        if policies is not None:
            if args.accumulation is not None:
                how = "given"
            elif gpu_memory is None:
                how = "no memory budget (--gpu-memory or --gpu): the lowest peak"
            elif any(r["fits"] for r in policies):
                how = "the fewest bytes a step whose peak fits"
            else:
                how = "none fits: the lowest peak"
            print(f"accumulation over {settings.grad_accum} micro-batches: {settings.accumulation} ({how})")
            for r in policies:
                mark = "*" if r["policy"] == settings.accumulation else " "
                print(
                    f" {mark} {r['policy']:<31} peak {fmt_bytes(r['peak_bytes']):>10}  collectives "
                    f"{fmt_bytes(r['comm_bytes_per_step']):>10} a step per rank"
                    + ("" if r["fits"] else "  (does not fit)")
                )
        if step is not None:
            print(step)
    return 0


def parse_gpu(name: str | None, sets: list[str] | None):
    """``--gpu`` and its ``--gpu-set FIELD=VALUE`` overrides -> a `Hardware`, or None without ``--gpu``."""
    if name is None:
        if sets:
            raise ValueError("--gpu-set overrides a --gpu preset: give --gpu too")
        return None
    overrides: dict[str, float | int] = {}
    for item in sets or []:
        field, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--gpu-set {item!r}: expected FIELD=VALUE, e.g. efficiency=0.4")
        try:
            overrides[field.strip()] = int(value) if value.strip().isdigit() else float(value)
        except ValueError:
            raise ValueError(f"--gpu-set {item!r}: {value!r} is not a number") from None
    return load_hardware(name, **overrides)
