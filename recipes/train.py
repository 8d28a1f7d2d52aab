"""Train a causal language model with FSDP2 through fsdp2kit.

    torchrun --nproc_per_node=N recipes/train.py --config recipes/configs/demo.toml [--table.key value ...]

Runs unchanged on a laptop CPU (gloo) or many GPUs (NCCL); see recipes/README.md for multi-node
launches. It reads top to bottom in the order fsdp2kit's pieces compose:

  1. start the process group and build the mesh;
  2. build the model (on the meta device when it would not fit in one process's memory);
  3. float8, activation checkpointing, per-block compile (each optional, each before sharding);
  4. shard_model, then fill the shards: materialize (fresh init) or load_pretrained;
  5. prefetch, then the optimizer (it must see the sharded parameters);
  6. resume from the newest complete checkpoint, train, checkpoint every N steps.

`--train.smoke true` proves a configuration in a minute before a long run: see support/smoke.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.config import ConfigError, config_to_dict, parse_config
from support.data import ByteTokenizer, PackedDataset, ResumableLoader, demo_corpus, read_texts, tokenize
from support.lora import apply_lora_table
from support.metrics import JsonlLogger, Timer, peak_memory_bytes

import fsdp2kit as fk  # first: keeps known-harmless import-time warnings out of the log
from fsdp2kit.mfu import peak_flops, transformer_flops_per_token
from fsdp2kit.models import build_causal_lm
from fsdp2kit.weights.adapters import peft_init_fn


def opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name: str = opt("demo", "a named config (demo, llama3-8b, llama3-70b, ...) or a local HF config/model directory")
    pretrained: bool = opt(False, "load the weights of the local directory in `name` (load_pretrained)")
    meta_init: bool = opt(True, "build on the meta device: no rank ever holds the whole model")


@dataclass
class DataConfig:
    files: str = opt("", "comma-separated local .txt/.jsonl files; empty: the embedded demo corpus")
    tokenizer: str = opt("", "a local Hugging Face tokenizer directory; empty: bytes (vocab 256)")
    text_field: str = opt("text", "the JSONL field that holds the text")
    seq_len: int = opt(128, "tokens per training sequence (packed, no padding)")
    batch_size: int = opt(8, "sequences per rank per micro-step")


@dataclass
class ParallelConfig:
    shard: int = opt(-1, "ranks that shard the model (-1: all that replicate leaves)")
    replicate: int = opt(1, "replica groups (HSDP when > 1, e.g. the number of nodes)")
    strategy: str | None = opt(None, "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | HYBRID_SHARD_ZERO2")
    mixed_precision: str | None = opt(None, "fp32 | bf16 | fp16")
    cpu_offload: bool = opt(False, "keep parameters, gradients and optimizer state in CPU memory")
    prefetch: int = opt(1, "blocks whose all-gather is issued ahead, forward and backward (0: off)")
    activation_checkpointing: str | None = opt(None, "full | selective | N (every N-th block)")
    compile: bool = opt(False, "torch.compile each block")
    float8: bool = opt(False, "float8 matmuls and float8 all-gather (torchao)")


@dataclass
class LoraConfig:
    r: int = opt(0, "LoRA rank; 0: full fine-tuning (no adapters)")
    alpha: float = opt(16.0, "LoRA scaling numerator (the update is alpha / r x B @ A)")
    dropout: float = opt(0.0, "dropout on the adapters' input")
    targets: str = opt("all-linear", "comma-separated Linear module names to adapt, or all-linear")
    qlora: bool = opt(False, "quantize the frozen base's block weights to 4-bit NF4 (QLoRA)")


@dataclass
class TrainConfig:
    steps: int = opt(300, "optimizer steps in total")
    lr: float = opt(3e-3, "peak learning rate (AdamW)")
    warmup: int = opt(30, "linear warm-up steps, then cosine decay to 10% of lr")
    weight_decay: float = opt(0.1, "AdamW weight decay")
    grad_accum: int = opt(1, "micro-steps per optimizer step (gradient accumulation)")
    clip: float = opt(1.0, "clip the gradient norm to this (0: off)")
    seed: int = opt(0, "seed for weights and data order")
    smoke: bool = opt(False, "run the pre-flight self-check instead of training")
    plan_only: bool = opt(False, "print the ShardPlan for the configured mesh and exit (no process group, no GPU)")
    fail_at_step: int = opt(-1, "testing aid: rank 1 kills itself at this step on its first attempt")


@dataclass
class CheckpointConfig:
    dir: str = opt("outputs/ckpt", "checkpoint root (step_XXXXXXXX directories)")
    every: int = opt(100, "save every N steps (and at the end); 0: only at the end")
    keep_last: int = opt(2, "complete checkpoints to keep")
    async_save: bool = opt(False, "save in the background while training continues")
    resume: bool = opt(True, "resume from the newest complete checkpoint in dir")


@dataclass
class LogConfig:
    every: int = opt(10, "log every N steps")
    jsonl: str = opt("outputs/train.jsonl", "JSONL metrics file (rank 0); empty: none")
    progress: bool = opt(True, "a progress bar on rank 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)


def build_data(cfg: DataConfig, info: fk.DistInfo, seed: int) -> tuple[ResumableLoader, int]:
    if cfg.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
        vocab = len(tokenizer)
    else:
        tokenizer, vocab = ByteTokenizer(), ByteTokenizer.vocab_size
    docs = read_texts(cfg.files.split(","), text_field=cfg.text_field) if cfg.files else demo_corpus()
    dataset = PackedDataset(tokenize(docs, tokenizer), cfg.seq_len)
    return ResumableLoader(dataset, cfg.batch_size, rank=info.rank, world_size=info.world_size, seed=seed), vocab


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_config(Config, argv, description=__doc__, prog="recipes/train.py")
    except ConfigError as e:
        sys.exit(f"config error: {e}")

    p = cfg.parallel
    if cfg.train.plan_only:
        # The model on the meta device (no memory), planned for the configured mesh: "does it fit?"
        if p.shard < 1:
            sys.exit("config error: --train.plan_only needs an explicit --parallel.shard (the GPUs per replica)")
        model = build_causal_lm(cfg.model.name, max_seq_len=cfg.data.seq_len, meta=True)
        if cfg.lora.r > 0:
            if cfg.lora.qlora:
                sys.exit("config error: --train.plan_only cannot plan QLoRA yet (NF4 needs real weights to quantize)")
            model = apply_lora_table(
                model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, targets=cfg.lora.targets,
                qlora=False, dtype=torch.bfloat16 if p.mixed_precision == "bf16" else torch.float32,
            )  # fmt: skip
        print(
            fk.estimate_plan(
                model,
                shard=p.shard,
                replicate=p.replicate,
                strategy=p.strategy,
                mixed_precision=p.mixed_precision,
                cpu_offload=p.cpu_offload,
            )
        )
        return

    # 1. process group and mesh
    info = fk.init_distributed()
    mesh = fk.make_mesh(shard=cfg.parallel.shard, replicate=cfg.parallel.replicate)
    torch.manual_seed(cfg.train.seed)
    loader, vocab = build_data(cfg.data, info, cfg.train.seed)

    # 2. the model, on the meta device unless asked otherwise
    lora = cfg.lora
    # QLoRA quantizes real weights: the base is built (and loaded) in host memory on every rank
    # first, then quantized; quantizing rows as load_pretrained streams them is not supported yet.
    quantize_first = lora.r > 0 and lora.qlora
    model = build_causal_lm(
        cfg.model.name,
        vocab_size=None if cfg.model.pretrained else vocab,
        max_seq_len=cfg.data.seq_len,
        meta=(cfg.model.meta_init or cfg.model.pretrained) and not quantize_first,
        device="cpu" if quantize_first else info.device,
    )
    if quantize_first and cfg.model.pretrained:
        fk.load_pretrained(model, cfg.model.name)
    if lora.r > 0:  # LoRA / QLoRA adapters: they change modules, so before everything else
        model = apply_lora_table(
            model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets, qlora=lora.qlora,
            dtype=torch.bfloat16 if p.mixed_precision == "bf16" else torch.float32,
        )  # fmt: skip
    if quantize_first:
        model.to(info.device)

    # 3. wrappers that change modules must come before sharding
    if p.float8:
        fk.enable_float8(model)
    if p.activation_checkpointing:
        ac = p.activation_checkpointing
        fk.apply_activation_checkpointing(model, mode=int(ac) if ac.isdigit() else ac)
    if p.compile:
        fk.compile_blocks(model)

    # 4. shard, then fill the shards
    plan = fk.shard_model(
        model, mesh, strategy=p.strategy, mixed_precision=p.mixed_precision, cpu_offload=p.cpu_offload
    )
    if info.is_main:
        print(plan, flush=True)
    if cfg.model.pretrained and not quantize_first:
        fk.load_pretrained(model, cfg.model.name)  # a peft model: the base only, adapters keep their init
    elif cfg.model.meta_init and not quantize_first:
        fk.materialize(model, init_fn=peft_init_fn(model) if lora.r > 0 else None)

    # 5. prefetch, then the optimizer
    if p.prefetch:
        fk.set_prefetch(model, forward=p.prefetch, backward=p.prefetch)
    trainable = [q for q in model.parameters() if q.requires_grad]  # a LoRA base keeps no optimizer state
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    t = cfg.train

    def lr_factor(step: int) -> float:
        if step < t.warmup:
            return (step + 1) / t.warmup
        progress = (step - t.warmup) / max(1, t.steps - t.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    if t.smoke:
        from support.smoke import run_smoke

        ok = run_smoke(model, optimizer, scheduler, loader, plan, lm_loss, info, Path(cfg.checkpoint.dir) / "smoke")
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)

    # 6. resume, train, checkpoint
    ck = fk.Checkpointer(cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save)
    extra = {"scheduler": scheduler, "data": loader}  # RNG states are saved per rank by the Checkpointer
    start = 0
    if cfg.checkpoint.resume:
        start = ck.load(model, optimizer=optimizer, extra=extra) or 0
        if start and info.is_main:
            print(f"resumed from {ck.root}/step_{start:08d}", flush=True)

    flops_per_token = transformer_flops_per_token(
        model, model.config.num_hidden_layers, model.config.hidden_size, cfg.data.seq_len
    )
    peak = peak_flops(info.device)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * t.grad_accum * info.world_size
    log = JsonlLogger(cfg.log.jsonl, enabled=info.is_main)
    log.log({"event": "start", "step": start, "config": config_to_dict(cfg), "world_size": info.world_size})
    bar = None
    if cfg.log.progress and info.is_main and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, unit="step")

    batches = iter(loader)
    timer, last_logged = Timer(info.device), start
    first_loss = last_loss = float("nan")
    for step in range(start, t.steps):
        if step == t.fail_at_step and info.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # a crash with no chance to clean up, as in real life
        loss_sum = torch.zeros((), device=info.device)
        for micro in range(t.grad_accum):
            batch = next(batches).to(info.device)
            with fk.no_sync(model) if micro < t.grad_accum - 1 else contextlib.nullcontext():
                loss = lm_loss(model, batch) / t.grad_accum
                loss.backward()
            loss_sum += loss.detach()
        if t.clip > 0:
            fk.clip_grad_norm_(model.parameters(), t.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        if done % cfg.log.every == 0 or done == t.steps or done == start + 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the loss of the global batch
            mem = torch.tensor([peak_memory_bytes(info.device)], dtype=torch.float64, device=info.device)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            dt = timer.lap() / (done - last_logged)
            last_logged = done
            record = {
                "step": done,
                "loss": loss_sum.item(),
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_per_step / dt,
                "peak_mem_gib": mem.item() / 2**30,
            }
            if peak:
                record["mfu"] = flops_per_token * tokens_per_step / dt / (peak * info.world_size)
            first_loss = record["loss"] if math.isnan(first_loss) else first_loss
            last_loss = record["loss"]
            log.log(record)
            if info.is_main:
                text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items())
                if bar:
                    bar.write(text)
                else:
                    print(text, flush=True)
        if bar:
            bar.update(1)
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < t.steps:
            ck.save(done, model, optimizer=optimizer, extra=extra)

    if start < t.steps:
        ck.save(t.steps, model, optimizer=optimizer, extra=extra)
    ck.wait()
    if bar:
        bar.close()
    if info.is_main:
        print(
            f"done: steps {start} -> {t.steps}, loss {first_loss:.4f} -> {last_loss:.4f}, "
            f"checkpoint {Path(cfg.checkpoint.dir).resolve()}/step_{t.steps:08d}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
