"""`fsdp2kit plan`: what each rank would hold for a model on a mesh, without a GPU."""

from __future__ import annotations


def add_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="what each rank would hold for a model on a mesh, without a GPU",
        description="Build MODEL (a named config such as llama3-8b, or a local Hugging Face directory) on the "
        "meta device and print the ShardPlan shard_model would produce on a (replicate x shard) mesh.",
    )
    p.add_argument("model", help="a named config (see fsdp2kit.models.NAMED_CONFIGS) or a local HF directory")
    p.add_argument("--shard", type=int, required=True, help="ranks that shard the model (e.g. GPUs per node)")
    p.add_argument("--replicate", type=int, default=1, help="replica groups (HSDP when > 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (the model's own TP plan)")
    p.add_argument(
        "--strategy", default=None, help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2"
    )
    p.add_argument("--mixed-precision", default=None, help="fp32, bf16 or fp16")
    p.add_argument("--cpu-offload", action="store_true")
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    from fsdp2kit.models import build_causal_lm
    from fsdp2kit.shard import estimate_plan

    model = build_causal_lm(args.model, meta=True)
    print(
        estimate_plan(
            model,
            shard=args.shard,
            replicate=args.replicate,
            tp=args.tp,
            strategy=args.strategy,
            mixed_precision=args.mixed_precision,
            cpu_offload=args.cpu_offload,
        )
    )
    return 0
