"""Train a causal language model with FSDP2 through fsdp2kit.

    torchrun --nproc_per_node=N recipes/train.py --config recipes/configs/demo.toml [--table.key value ...]

Runs unchanged on a laptop CPU (gloo) or many GPUs (NCCL); see recipes/README.md for multi-node
launches. It reads top to bottom in the order fsdp2kit's pieces compose:

  1. start the process group and build the mesh;
  2. build the model (on the meta device when it would not fit in one process's memory);
  3. float8, tensor parallelism, activation checkpointing, per-block compile (each optional, each
     before sharding);
  4. shard_model, then fill the shards: materialize (fresh init) or load_pretrained;
  5. prefetch, then the optimizer (it must see the sharded parameters);
  6. resume from the newest complete checkpoint, train, checkpoint every N steps.

`--train.smoke true` proves a configuration in a minute before a long run: see support/smoke.py.
A mistake in the config, an option, the data or the model directory stops the launch with one block
from rank 0 (what, where, the fix), mostly before any process group starts; `--debug` (or
FSDP2KIT_DEBUG=1) shows its Python traceback instead: see support/errors.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp2kit as fk
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit.accumulation import check_accumulation
from fsdp2kit.diagnostics import RankMonitor, check_finite
from fsdp2kit.mfu import peak_flops, transformer_flops_per_token
from fsdp2kit.models import build_causal_lm
from fsdp2kit.parallel.context_parallel import RING_PACKED, check_ring_seq
from fsdp2kit.parallel.cp_inputs import check_seq
from fsdp2kit.planner.api import plan_shards
from fsdp2kit.weights.adapters import peft_init_fn
from support.config import config_to_dict, parse_config
from support.data import DataError, ResumableLoader, check_vocab, describe, setup_data, setup_tokenizer
from support.errors import ConfigError, UsageError, run_recipe
from support.evaluate import evaluate
from support.export import export_model
from support.loader import SplitBatches
from support.lora import apply_lora_table, split_targets
from support.loss import answer_loss_sum, backward_global_mean
from support.metrics import LivePeak, Timer, peak_memory_bytes, peak_memory_key
from support.options import Config, optimizer_args
from support.positions import seq_len_problem
from support.preemption import abort_quietly, announce_stop, stop_after_signal
from support.resources import RESOURCE_KEYS, process_resources
from support.rows import check_source
from support.startup import memory_plan, optimizer_state_dtype, summary
from support.tracking import RunLog


def build_data(cfg: Config, info: fk.DistInfo, dp_info: fk.DistInfo):
    """(tokenizer, training loader, held-out rows or None): tokenized once per node, cached (support/data.py).

    ``dp_info`` numbers the data-parallel groups: the ranks of one TP group read the same batches.
    """
    ranks = {"rank": info.rank, "local_rank": info.local_rank, "world_size": info.world_size}
    tokenizer = setup_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, **ranks)
    splits = setup_data(cfg.data, cfg.eval, tokenizer, seed=cfg.train.seed, **ranks)
    if info.is_main:
        print(describe(splits, cfg.data.seq_len), flush=True)
    loader = ResumableLoader(
        splits.train, cfg.data.batch_size, rank=dp_info.rank, world_size=dp_info.world_size, seed=cfg.train.seed
    )
    return tokenizer, loader, splits.eval


def mean_answer_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's mean loss over its answer tokens (the smoke check's loss)."""
    return answer_loss_sum(model, batch) / (batch["labels"] != -100).sum().clamp(min=1)


def check_before_start(cfg: Config) -> None:
    """The mistakes that the config and the model's own config show, found before any process group work."""
    p, lora = cfg.parallel, cfg.lora
    if cfg.train.plan_only and p.shard < 1:
        raise ConfigError("train.plan_only needs an explicit --parallel.shard (the GPUs per replica)")
    try:
        problem = seq_len_problem(cfg)
    except ValueError as e:  # an unknown named config, not a directory
        raise UsageError(str(e), kind="model") from e
    except OSError as e:  # a directory without a config.json transformers can read
        raise UsageError(f"model.name = {cfg.model.name!r}: {e}", kind="model") from e
    if problem:
        raise ConfigError(problem)
    try:
        check_seq(f"data.seq_len {cfg.data.seq_len} with parallel.cp {p.cp}", cfg.data.seq_len, p.cp)
        if p.cp > 1 and p.cp_style == "ring":  # what the ring refuses at its first forward, before any process
            if cfg.data.packing:
                raise ValueError(f"parallel.cp_style = 'ring' with data.packing = true: {RING_PACKED}")
            check_ring_seq(cfg.data.seq_len, p.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        optimizer_args(cfg)
        check_accumulation(cfg.train.accumulation, hsdp=p.replicate > 1)
    except ValueError as e:  # a choice that cannot run with the rest of the config
        raise ConfigError(str(e)) from e
    for role, files in (("data", cfg.data.files), ("eval", cfg.eval.files)):
        for f in [f for f in files.split(",") if f and not cfg.train.plan_only]:  # a plan reads no data
            check_source(f, role)  # exists and is of a type the data layer reads: before any process group
    if cfg.data.tokenizer and not cfg.train.plan_only and not Path(cfg.data.tokenizer).is_dir():
        raise DataError(f"data.tokenizer = {cfg.data.tokenizer!r}: no such directory (a local Hugging Face tokenizer)")
    if lora.replicate_adapters and lora.r == 0:
        raise ConfigError("lora.replicate_adapters = true replicates LoRA adapters: set lora.r (> 0) too")
    if lora.replicate_adapters and p.cpu_offload:
        raise ConfigError(
            "lora.replicate_adapters = true with parallel.cpu_offload = true: replicated adapters stay on the device"
        )
    if lora.r > 0 and lora.targets != "all-linear":
        # The targets against the model's Linear names, on the meta device (no memory, no data yet):
        # a typo here must not wait for the data to be tokenized.
        positions = cfg.model.max_position_embeddings or None
        model = build_causal_lm(cfg.model.name, max_position_embeddings=positions, meta=True)
        try:
            apply_lora_table(model, r=lora.r, alpha=lora.alpha, dropout=0.0, targets=lora.targets, qlora=False,
                             dtype=torch.float32)  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"lora.targets = {lora.targets!r}: {e}") from e


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(Config, argv, description=__doc__, prog="recipes/train.py")
    check_before_start(cfg)

    p = cfg.parallel
    lora_base_dtype = torch.bfloat16 if p.mixed_precision in ("bf16", "pure_bf16") else torch.float32
    if cfg.train.plan_only:
        # The model on the meta device (no memory), planned for the configured mesh: "does it fit?"
        positions = cfg.model.max_position_embeddings or None
        model = build_causal_lm(cfg.model.name, max_position_embeddings=positions, meta=True)
        # The model the run would train, planned for GPUs: the adapters as [lora] puts them
        # (QLoRA too: quantize_nf4 on the meta device leaves NF4 placeholders).
        lora = {}
        if cfg.lora.r > 0:
            targets = split_targets(cfg.lora.targets)
            targets = targets if isinstance(targets, str) else tuple(targets)
            lora = {"lora": cfg.lora.r, "qlora": cfg.lora.qlora, "lora_targets": targets}
        print(memory_plan(model, cfg, shard=p.shard, replicate=p.replicate, device="cuda", **lora))
        print(
            plan_shards(
                model,
                shard=p.shard,
                replicate=p.replicate,
                tp=p.tp,
                cp=p.cp,
                cp_style=p.cp_style,
                strategy=p.strategy,
                mixed_precision=p.mixed_precision,
                cpu_offload=p.cpu_offload,
                **lora,
            )
        )
        return

    optim_args = optimizer_args(cfg)  # checked in check_before_start
    # 1. process group and mesh
    info = fk.init_distributed(timeout=cfg.train.timeout)
    try:
        mesh = fk.make_mesh(shard=p.shard, replicate=p.replicate, tp=p.tp, cp=p.cp)
    except ValueError as e:  # sizes that do not fit the world: the same answer on every rank
        raise ConfigError(f"[parallel] {str(e).removeprefix('make_mesh: ')}") from e
    torch.manual_seed(cfg.train.seed)
    # The ranks of one TP group compute on one batch, and so do those of one cp group (each keeps its own
    # chunks of the sequences): data is split over the data-parallel groups.
    group = p.tp * p.cp
    dp_info = dataclasses.replace(info, rank=info.rank // group, world_size=info.world_size // group)
    try:
        tokenizer, loader, eval_rows = build_data(cfg, info, dp_info)
    except FileNotFoundError as e:  # a tokenizer directory: the same answer on every rank
        raise DataError(str(e)) from e
    vocab = len(tokenizer)

    # 2. the model, on the meta device unless asked otherwise
    lora = cfg.lora
    # QLoRA from a pretrained directory is built on the meta device like any other run:
    # quantize_nf4 leaves NF4 placeholders, shard_model shards them and load_pretrained quantizes
    # each rank's rows as it reads them (no rank holds the bf16 base). Only QLoRA from a fresh
    # init quantizes real weights first: the random base is built in host memory on every rank.
    quantize_first = lora.r > 0 and lora.qlora and not cfg.model.pretrained
    model = build_causal_lm(
        cfg.model.name,
        vocab_size=None if cfg.model.pretrained else vocab,
        max_position_embeddings=cfg.model.max_position_embeddings or None,
        meta=(cfg.model.meta_init or cfg.model.pretrained) and not quantize_first,
        device="cpu" if quantize_first else info.device,
    )
    check_vocab(tokenizer, model)  # the same answer on every rank: no collective needed

    if lora.r > 0:  # LoRA / QLoRA adapters: they change modules, so before everything else
        model = apply_lora_table(
            model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets, qlora=lora.qlora,
            dtype=lora_base_dtype,
        )  # fmt: skip
    if quantize_first:
        model.to(info.device)

    # Will it fit? The planner's prediction for this rank, logged beside the measured peak below: the
    # model as it trains (LoRA targets and dtypes), so its figures are the ShardPlan's (support/startup.py).
    memory = predicted = None
    if info.is_main:
        dp = {"shard": mesh["shard"].size()}
        dp["replicate"] = mesh["replicate"].size() if "replicate" in mesh.mesh_dim_names else 1
        memory = memory_plan(model, cfg, **dp, device="cuda" if info.device.type == "cuda" else "cpu")
        if not isinstance(memory, str):
            predicted = memory.peak_bytes - memory.parts["margin"]  # what max_memory_allocated sees

    # 3. wrappers that change modules must come before sharding
    if p.float8:
        fk.enable_float8(model)
    if p.tp > 1:
        fk.apply_tensor_parallel(model, mesh)  # the model's own transformers TP plan
    split = None
    if p.cp > 1:
        try:
            fk.apply_context_parallel(model, mesh, style=p.cp_style)
        except ValueError as e:  # heads that do not divide by cp, an unsupported attention kernel
            raise ConfigError(f"[parallel] cp = {p.cp}: {e}") from e

        def split(batch):
            return fk.split_for_context_parallel(batch, mesh)

        loader = SplitBatches(loader, split)
    if p.activation_checkpointing:
        ac = p.activation_checkpointing
        fk.apply_activation_checkpointing(model, mode=int(ac) if ac.isdigit() else ac)
    if p.compile:
        with warnings.catch_warnings():
            # Its use_cache warning does not apply: every forward here passes use_cache=False (support/loss.py).
            warnings.filterwarnings("ignore", message="compile_blocks: model.config.use_cache")
            fk.compile_blocks(model)

    # 4. shard, then fill the shards
    plan = fk.shard_model(
        model,
        mesh,
        strategy=p.strategy,
        mixed_precision=p.mixed_precision,
        cpu_offload=p.cpu_offload,
        replicate_adapters=lora.replicate_adapters,
    )
    if info.is_main:
        if cfg.log.verbose:
            print(f"{memory}\n{plan}", flush=True)
        print(summary(cfg, plan, memory, info.device), flush=True)
    if cfg.model.pretrained and not quantize_first:
        try:
            fk.load_pretrained(model, cfg.model.name)  # a peft model: the base only, adapters keep their init
        except (FileNotFoundError, ValueError) as e:  # no weights, wrong keys or a damaged file: every rank alike
            raise UsageError(f"model.name = {cfg.model.name!r}: {e}", kind="model") from e
    elif cfg.model.meta_init and not quantize_first:
        fk.materialize(model, init_fn=peft_init_fn(model) if lora.r > 0 else None)

    # 5. prefetch, then the optimizer
    if p.prefetch:
        fk.set_prefetch(model, forward=p.prefetch, backward=p.prefetch)
    optimizer = fk.make_optimizer(model, **optim_args)  # its trainable parameters: a LoRA base keeps no state
    t = cfg.train

    def lr_factor(step: int) -> float:
        if step < t.warmup:
            return (step + 1) / t.warmup
        progress = (step - t.warmup) / max(1, t.steps - t.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    if t.smoke:
        from support.smoke import run_smoke, smoke_dir

        where = smoke_dir(cfg.checkpoint.dir)  # beside the checkpoints, never in them; removed afterwards
        ok = run_smoke(model, optimizer, scheduler, loader, plan, mean_answer_loss, info, where)
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)

    # 6. resume, train, checkpoint
    ck = fk.Checkpointer(cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save)
    extra = {"scheduler": scheduler, "data": loader}  # RNG states are saved per rank by the Checkpointer
    start = 0
    if cfg.checkpoint.resume:
        try:
            start = ck.load(model, optimizer=optimizer, extra=extra) or 0
        except fk.CheckpointError as e:  # a damaged step, or one this run cannot take: every rank alike
            raise UsageError(
                f"{e}\nMove that step out of {cfg.checkpoint.dir} to resume from an older one, or start afresh "
                "with --checkpoint.resume false",
                kind="checkpoint",
            ) from e
        if start and info.is_main:
            print(f"resumed from {ck.root}/step_{start:08d}", flush=True)

    flops_per_token = transformer_flops_per_token(
        model, model.config.num_hidden_layers, model.config.hidden_size, cfg.data.seq_len
    )
    peak = peak_flops(info.device)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * t.grad_accum * dp_info.world_size
    lc = cfg.log
    log = RunLog(
        lc.jsonl,
        trackers=lc.trackers,
        directory=lc.tracker_dir,
        project=lc.project,
        run_name=lc.run_name,
        enabled=info.is_main,
    )
    monitor = RankMonitor(model, micro_steps=t.grad_accum, check_every=t.check_every, timeout=t.check_timeout)
    # from here on a signal (Ctrl-C too) stops after the current step, with a checkpoint
    stop = fk.StopSignal(t.stop_signals, on_signal=announce_stop if info.is_main else None)
    log.log(
        {
            "event": "start",
            "step": start,
            "config": config_to_dict(cfg),
            "world_size": info.world_size,
            "master_dtype": plan.master_dtype,  # also the second line of the printed ShardPlan
            "optimizer_state_dtype": optimizer_state_dtype(cfg, plan),  # also in the summary's precision line
            # The full plans, which the console shows only with --log.verbose (support/startup.py).
            "memory_plan": str(memory),
            "shard_plan": str(plan),
        }
    )
    bar = None
    if cfg.log.progress and info.is_main and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, unit="step")

    batches = iter(loader)
    timer, last_logged = Timer(info.device), start
    first_loss = last_loss = float("nan")
    skipped = 0
    live_peak = LivePeak(info.device, at_step=start + 1)  # CPU: live tensor bytes, beside the prediction
    mem_key = peak_memory_key(info.device)
    for step in range(start, t.steps):
        if step == t.fail_at_step and info.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # a crash with no chance to clean up, as in real life
        micro = [{k: v.to(info.device) for k, v in next(batches).items()} for _ in range(t.grad_accum)]
        skip = int(step + 1 == t.skip_micro_at and info.rank == 1)  # testing aid: the desync the monitor must name
        micro = micro[skip:]
        monitor.step(step + 1)  # steps are counted from 1 in every message, as in the log
        # a collective that fails or times out names every rank's position
        # the first step's collectives, counted by mesh dimension and kind (one JSONL event below)
        counting = fk.count_collectives(mesh) if step == start else contextlib.nullcontext()
        with monitor.guard(), live_peak.watch(step, model, optimizer), counting as counts:
            # the mean over the answer tokens of the global batch (every rank, every micro-step): support/loss.py.
            # With TP, each of a TP group's ranks counts the same tokens: the count over all ranks and the
            # world size are both TP times too large, and the factors cancel. With cp, each rank counts its own
            # chunks' tokens and FSDP averages over the cp ranks too: the world size is the factor again.
            loss_sum, answer_count = backward_global_mean(
                model,
                micro,
                dp_size=mesh.size(),
                device=info.device,
                before_micro=lambda i, b, skip=skip: monitor.micro_step(i + skip, b["input_ids"]),
                accumulation=t.accumulation,
            )
            monitor.step_end()
            grad_norm = fk.clip_grad_norm_(model.parameters(), t.clip if t.clip > 0 else math.inf)
            monitor.phase("optimizer")
            if check_finite(model, step=step + 1, loss=loss_sum, grad_norm=grad_norm, on_nonfinite=t.on_nonfinite):
                optimizer.step()
            else:
                skipped += 1
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        done = step + 1
        if counts is not None:  # this rank's collectives in the first step: the log file only
            log.log({"event": "collectives", "step": done, "accumulation": t.accumulation, "groups": counts.summary()})
        if done % cfg.log.every == 0 or done == t.steps or done == start + 1:
            dist.all_reduce(loss_sum)  # the loss of the global batch: every rank's sum over the global count
            mem = torch.zeros(info.world_size, dtype=torch.float64, device=info.device)
            mem[info.rank] = peak_memory_bytes(info.device)
            dist.all_reduce(mem)  # every rank's peak, for the trackers
            if cfg.log.resources:
                res = torch.zeros(info.world_size, len(RESOURCE_KEYS), dtype=torch.float64, device=info.device)
                res[info.rank] = torch.tensor(process_resources(), dtype=torch.float64)
                dist.all_reduce(res)
            dt = timer.lap() / (done - last_logged)
            last_logged = done
            record = {
                "step": done,
                "loss": loss_sum.item() / max(1.0, answer_count.item()),
                "lr": float(scheduler.get_last_lr()[0]),  # torchao keeps lr as a tensor
                "tokens_per_s": tokens_per_step / dt,
                "grad_norm": grad_norm.item(),
                "skipped_steps": skipped,
            }
            if peak:
                record["mfu"] = flops_per_token * tokens_per_step / dt / (peak * info.world_size)
            # named for what each device measures (support/metrics.py): CUDA max allocated, CPU process RSS
            record[mem_key] = mem.max().item() / 2**30
            record[f"{mem_key}_per_rank"] = [m / 2**30 for m in mem.tolist()]
            if cfg.log.resources:
                record.update({f"{k}_per_rank": res[:, i].tolist() for i, k in enumerate(RESOURCE_KEYS)})
            if predicted is not None:
                record["predicted_peak_gib"] = predicted / 2**30  # fsdp2kit.plan_memory, before training
            if live_peak.peak is not None:  # CPU: rank 0's live tensor bytes in one step, the figure predicted
                record["peak_live_gib"] = live_peak.peak / 2**30
                record["peak_live_step_s"] = live_peak.seconds
            first_loss = record["loss"] if math.isnan(first_loss) else first_loss
            last_loss = record["loss"]
            log.log(record)
            if info.is_main:
                shown = {k: v for k, v in record.items() if not isinstance(v, list)}
                if info.device.type == "cpu" and "peak_live_gib" not in record:
                    # On CPU the prediction is shown only beside the live bytes it predicts, never alone beside RSS.
                    shown.pop("predicted_peak_gib", None)
                text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
                if bar:
                    bar.write(text)
                else:
                    print(text, flush=True)
        if eval_rows is not None and ((cfg.eval.every and done % cfg.eval.every == 0) or done == t.steps):
            scores = evaluate(
                model,
                eval_rows,
                cfg.eval.batch_size,
                rank=dp_info.rank,
                world_size=dp_info.world_size,
                device=info.device,
                split=split,
            )
            log.log({"step": done, **scores})
            if info.is_main:
                text = f"step {done}  eval_loss {scores['eval_loss']:.4g}  eval_ppl {scores['eval_ppl']:.4g}"
                bar.write(text) if bar else print(text, flush=True)
        if bar:
            bar.update(1)
        saved = bool(cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < t.steps)
        if saved:
            monitor.phase("checkpoint")
            ck.save(done, model, optimizer=optimizer, extra=extra)
        if done < t.steps and stop.should_stop(info.device):  # one tiny all-reduce: a signal on any rank
            monitor.close()
            log.close()
            stop_after_signal(
                ck, done, model, optimizer, extra, saved=saved, stop=stop, is_main=info.is_main, requeue=t.requeue
            )

    if start < t.steps:
        ck.save(t.steps, model, optimizer=optimizer, extra=extra)
    ck.wait()
    monitor.close()
    log.close()
    if bar:
        bar.close()
    if cfg.export.hf_dir:
        export_model(
            model, tokenizer, cfg.export.hf_dir, is_main=info.is_main, merge=cfg.export.merge, dtype=cfg.export.dtype
        )
    if info.is_main:
        print(
            f"done: steps {start} -> {t.steps}, loss {first_loss:.4f} -> {last_loss:.4f}, "
            f"checkpoint {Path(cfg.checkpoint.dir).resolve()}/step_{t.steps:08d}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    with quiet_imports(), abort_quietly():  # torchao's lines on a CPU build; a second Ctrl-C: one line, exit 130
        run_recipe(main)  # a config, data or model mistake: one block from rank 0, no traceback (support/errors.py)
