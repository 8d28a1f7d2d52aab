"""The recipe's options: one dataclass per TOML table, each field with its default, its --help text and the
values it takes (checked by support/config.py for the TOML file and the command line alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fsdp2kit.accumulation import ACCUMULATION
from fsdp2kit.diagnostics import ON_NONFINITE
from fsdp2kit.optim import OPTIMIZERS
from fsdp2kit.parallel.context_parallel import STYLES as CP_STYLES
from fsdp2kit.precision import PRECISIONS
from fsdp2kit.shard import STRATEGIES
from fsdp2kit.stop import parse_signals
from support.export import EXPORT_DTYPES
from support.formats import FORMATS
from support.tracking import TRACKERS


def opt(default, help: str, **rules):
    """A field; ``rules``: ``choices``, ``check`` (value -> value to store, or ValueError) or ``minimum``."""
    return field(default=default, metadata={"help": help, **rules})


def _ac_mode(value: str) -> str:
    if value.isdigit() and int(value) >= 1:
        return value
    if value.lower() in ("full", "selective", "op"):
        return value.lower()
    raise ValueError("expected full, selective, op or a number N >= 1 (every N-th block)")


def _signals(value: str) -> str:
    parse_signals(value)
    return value


def _trackers(value: str) -> str:
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker {unknown[0]!r}; known: {', '.join(TRACKERS)}")
    return value


def _betas(value: str) -> str:
    parts = [v.strip() for v in str(value).split(",")]
    try:
        b1, b2 = (float(v) for v in parts)
    except ValueError:
        raise ValueError("expected two numbers, beta1,beta2 (e.g. 0.9,0.95)") from None
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError("each beta must be in [0, 1)")
    return f"{b1},{b2}"


def _targets(value: str) -> str:
    if not [t for t in value.split(",") if t.strip()]:
        raise ValueError("empty: name the Linear modules to adapt (e.g. q_proj,v_proj), or all-linear")
    return value


@dataclass
class ModelConfig:
    name: str = opt("demo", "a named config (demo, llama3-8b, llama3-70b, ...) or a local HF config/model directory")
    pretrained: bool = opt(False, "load the weights of the local directory in `name` (load_pretrained)")
    meta_init: bool = opt(True, "build on the meta device: no rank ever holds the whole model")
    max_position_embeddings: int = opt(
        0, "set the model's position limit (a data.seq_len above the config's is refused without it); 0: as configured"
    )


@dataclass
class DataConfig:
    files: str = opt("", "comma-separated local .jsonl/.json/.parquet/.arrow/.txt files; empty: the demo corpus")
    format: str = opt(
        "text",
        "text (train on every token) | chat (a messages list) | completion (prompt, completion)",
        choices=FORMATS,
    )
    tokenizer: str = opt("", "a local Hugging Face tokenizer directory; empty: the demo BPE, trained into cache_dir")
    seq_len: int = opt(128, "tokens per training sequence", minimum=1)
    batch_size: int = opt(8, "sequences per rank per micro-step", minimum=1)
    packing: bool = opt(True, "pack several examples per sequence (they never attend to each other); false: pad")
    text_field: str = opt("text", "format=text: the field that holds the text")
    messages_field: str = opt("messages", "format=chat: the field that holds the list of {role, content}")
    prompt_field: str = opt("prompt", "format=completion: the field that holds the prompt")
    completion_field: str = opt("completion", "format=completion: the field that holds the answer (trained on)")
    template: str = opt("", "format=completion: a str.format template over the record's fields making the prompt")
    cache_dir: str = opt("outputs/data_cache", "tokenized rows are cached here, keyed by files, tokenizer, settings")
    num_proc: int = opt(0, "processes that tokenize (0: up to 8, one per core)")


@dataclass
class EvalConfig:
    files: str = opt("", "held-out files (same format as [data]); empty: a fraction of the data, or no eval")
    fraction: float = opt(0.0, "hold out this fraction of the [data] records when no eval files are given")
    every: int = opt(0, "evaluate every N steps (0: only at the end); each covers the whole held-out split")
    batch_size: int = opt(8, "sequences per rank per eval forward", minimum=1)


@dataclass
class ExportConfig:
    hf_dir: str = opt("", "at the end, write a Hugging Face model (and its tokenizer) here; empty: no export")
    merge: bool = opt(
        True,
        "with [lora]: true writes the base with the adapters merged in (a plain model for from_pretrained); "
        "false writes a PEFT adapter directory (for PeftModel.from_pretrained)",
    )
    dtype: str = opt(
        "auto",
        "weights' dtype: auto (the pretrained checkpoint's, else as trained) | fp32 | bf16 | fp16",
        choices=tuple(EXPORT_DTYPES),
    )


@dataclass
class ParallelConfig:
    shard: int = opt(-1, "ranks that shard the model (-1: all that replicate leaves)")
    replicate: int = opt(1, "replica groups (HSDP when > 1, e.g. the number of nodes)", minimum=1)
    tp: int = opt(1, "tensor-parallel ranks, the innermost mesh dim (e.g. GPUs per node; 1: off)", minimum=1)
    cp: int = opt(
        1,
        "context-parallel ranks: each sequence split over them, attention as cp_style says (long sequences; "
        "data.seq_len must divide by 2 x cp, with all_to_all heads and KV heads by cp; 1: off)",
        minimum=1,
    )
    cp_style: str = opt(
        "all_to_all",
        "with cp > 1: all_to_all (Ulysses: CPU and CUDA, packed rows kept apart) | ring (CUDA only, torch's ring "
        "attention: data.packing false, data.seq_len a multiple of 64 x cp; any number of heads)",
        choices=CP_STYLES,
    )
    strategy: str | None = opt(
        None, "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | HYBRID_SHARD_ZERO2", choices=tuple(STRATEGIES)
    )
    mixed_precision: str | None = opt(
        None,
        "bf16 | fp16 (fp32 master weights whatever the checkpoint's dtype) | pure_bf16 (bf16 weights and state) | fp32",
        choices=tuple(PRECISIONS),
    )
    cpu_offload: bool = opt(False, "keep parameters, gradients and optimizer state in CPU memory")
    prefetch: int = opt(1, "blocks whose all-gather is issued ahead, forward and backward (0: off)", minimum=0)
    activation_checkpointing: str | None = opt(
        None,
        "full | selective | op (torchtitan's: attention and every other matmul) | N (every N-th block)",
        check=_ac_mode,
    )
    compile: bool = opt(False, "torch.compile each block")
    float8: bool = opt(False, "float8 matmuls and float8 all-gather (torchao)")


@dataclass
class LoraConfig:
    r: int = opt(0, "LoRA rank; 0: full fine-tuning (no adapters)", minimum=0)
    alpha: float = opt(16.0, "LoRA scaling numerator (the update is alpha / r x B @ A)")
    dropout: float = opt(0.0, "dropout on the adapters' input")
    targets: str = opt("all-linear", "comma-separated Linear module names to adapt, or all-linear", check=_targets)
    qlora: bool = opt(False, "quantize the frozen base's block weights to 4-bit NF4 (QLoRA)")
    replicate_adapters: bool = opt(
        False, "keep the adapters whole on every rank, all-reduced once a step; the base sharded (docs/accumulation.md)"
    )


@dataclass
class TrainConfig:
    steps: int = opt(300, "optimizer steps in total", minimum=0)
    lr: float = opt(3e-3, "peak learning rate (the older name of optim.lr)")
    warmup: int = opt(30, "linear warm-up steps, then cosine decay to 10% of lr")
    weight_decay: float = opt(0.1, "AdamW weight decay (the older name of optim.weight_decay)")
    grad_accum: int = opt(1, "micro-steps per optimizer step (gradient accumulation)", minimum=1)
    accumulation: str = opt(
        "regather",
        "how micro-steps communicate: regather | keep_gathered | defer_all_reduce (HSDP) | no_sync | "
        "keep_gathered_defer_all_reduce (HSDP) | keep_gathered_no_sync (fewer bytes, more memory: "
        "docs/accumulation.md)",
        choices=tuple(ACCUMULATION),
    )
    clip: float = opt(1.0, "clip the gradient norm to this (0: off)")
    seed: int = opt(0, "seed for weights and data order")
    smoke: bool = opt(
        False, "run the pre-flight self-check instead of training (its checkpoint: <checkpoint.dir>.smoke, removed)"
    )
    plan_only: bool = opt(
        False, "print the memory plan and ShardPlan for the configured mesh and exit (no process group, no GPU)"
    )
    fail_at_step: int = opt(-1, "testing aid: rank 1 kills itself at this step on its first attempt")
    skip_micro_at: int = opt(-1, "testing aid: rank 1 skips micro-step 0 of step N (counted from 1)")
    on_nonfinite: str = opt(
        "raise", "a NaN/Inf loss or gradient norm: raise (naming the module) | skip the step", choices=ON_NONFINITE
    )
    timeout: float = opt(600.0, "seconds a collective may wait before it fails (the process group's timeout)")
    check_every: int = opt(10, "compare step, micro-step and batch shape across ranks every N steps (0: off)")
    check_timeout: float = opt(60.0, "seconds a rank waits at a check for the others before naming who is where")
    stop_signals: str = opt(
        "SIGTERM,SIGUSR1,SIGINT",
        "signals that stop after the current step with a checkpoint (a second Ctrl-C aborts)",
        check=_signals,
    )
    requeue: bool = opt(True, "after such a stop under Slurm, scontrol requeue the job")


@dataclass
class OptimConfig:
    name: str = opt(
        "adamw", "adamw | adamw8bit | adamw4bit | adamw_fp8 | adamw_bf16sr (needs pure_bf16)", choices=OPTIMIZERS
    )
    lr: float | None = opt(None, "peak learning rate; none: [train] lr, its older name (set one of the two)")
    weight_decay: float | None = opt(None, "decoupled weight decay; none: [train] weight_decay, its older name")
    betas: str = opt("0.9,0.999", "AdamW's beta1,beta2 (the decay of the gradient's mean and square)", check=_betas)
    eps: float = opt(1e-8, "AdamW's epsilon, added to the root of the squared-gradient average", minimum=0.0)
    offload: bool = opt(
        False, "AdamW's state and update in pinned host memory, parameters and gradients on the GPU (CUDA only)"
    )


def optimizer_args(cfg: Config) -> dict:
    """`fk.make_optimizer`'s keyword arguments from ``[optim]`` (and the older ``[train] lr`` /
    ``weight_decay``); ValueError for what cannot run, before any process group exists."""
    o, t, default = cfg.optim, cfg.train, TrainConfig()
    out = {
        "name": o.name,
        "offload": o.offload,
        "betas": tuple(float(b) for b in _betas(o.betas).split(",")),
        "eps": o.eps,
    }
    for key in ("lr", "weight_decay"):
        new, old = getattr(o, key), getattr(t, key)
        if new is not None and old != getattr(default, key) and new != old:
            raise ValueError(f"optim.{key}={new} and train.{key}={old}: set it once, as optim.{key}")
        out[key] = old if new is None else new
    if o.name == "adamw_bf16sr" and cfg.parallel.mixed_precision != "pure_bf16":
        raise ValueError("optim.name=adamw_bf16sr steps bf16 parameters: set parallel.mixed_precision=pure_bf16")
    if o.offload and o.name != "adamw":
        raise ValueError(f"optim.offload is for optim.name=adamw (not {o.name}: a low-bit state is already small)")
    if o.offload and cfg.parallel.cpu_offload:
        raise ValueError(
            "optim.offload and parallel.cpu_offload: choose one (cpu_offload already keeps the state on the host)"
        )
    # A plan of it runs anywhere: it is what the planner's suggestions are started with.
    if o.offload and not torch.cuda.is_available() and not cfg.train.plan_only:
        raise ValueError(
            "optim.offload keeps parameters on the GPU and the state in host memory: this machine has no GPU"
        )
    return out


@dataclass
class CheckpointConfig:
    dir: str = opt("outputs/ckpt", "checkpoint root (step_XXXXXXXX directories)")
    every: int = opt(100, "save every N steps (and at the end); 0: only at the end")
    keep_last: int = opt(2, "complete checkpoints to keep", minimum=1)
    async_save: bool = opt(False, "save in the background while training continues")
    resume: bool = opt(True, "resume from the newest complete checkpoint in dir")


@dataclass
class LogConfig:
    every: int = opt(10, "log every N steps", minimum=1)
    verbose: bool = opt(False, "print the full memory plan and ShardPlan at start-up (always in the jsonl start event)")
    jsonl: str = opt("outputs/train.jsonl", "JSONL metrics file (rank 0); empty: none")
    progress: bool = opt(True, "a progress bar on rank 0")
    trackers: str = opt(
        "", "comma-separated: tensorboard, wandb (offline), mlflow (local files); empty: none", check=_trackers
    )
    tracker_dir: str = opt("outputs/tracking", "where the trackers write (tensorboard/, wandb/, mlruns/)")
    project: str = opt("fsdp2kit", "the W&B project / MLflow experiment")
    run_name: str = opt("", "the run's name in the trackers (empty: 'run')")
    resources: bool = opt(False, "log each rank's current RSS, open file descriptors and threads (leak hunting)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
