"""What the recipe says when it starts: a few lines on rank 0, the full plans in the log.

A launch prints the data summary, then `summary` (model, mesh, dtypes, predicted peak against
the device's memory, where the log and checkpoints go). The full memory plan (`fsdp2kit.plan_memory`)
and ShardPlan (`fsdp2kit.shard_model`) are written to the JSONL log's ``start`` event under
``memory_plan`` and ``shard_plan`` (``python recipes/summary.py LOG --plans`` prints them), and
to the console as well with ``--log.verbose true``; ``--train.plan_only true`` prints both and exits.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import fsdp2kit as fk
from fsdp2kit._internal.fmt import fmt_bytes, fmt_count
from fsdp2kit.planner.report import MemoryPlan
from support.options import Config

__all__ = ["device_memory", "memory_plan", "summary"]


def memory_plan(model: nn.Module, cfg: Config, *, shard: int, replicate: int, device: str, **lora) -> MemoryPlan | str:
    """The planner's prediction for one rank of this run, or why there is none (a plan is advice:
    a model the planner cannot trace still trains). ``lora``: `fsdp2kit.plan_memory`'s LoRA
    arguments, for a model not yet wrapped by peft (``--train.plan_only``)."""
    p, ac = cfg.parallel, cfg.parallel.activation_checkpointing
    try:
        return fk.plan_memory(
            model,
            shard=shard,
            replicate=replicate,
            tp=p.tp,
            cp=p.cp,
            cp_style=p.cp_style,
            packed=cfg.data.packing,  # under cp, packed rows add a document mask
            batch=cfg.data.batch_size,
            seq=cfg.data.seq_len,
            activation_checkpointing=int(ac) if ac and ac.isdigit() else ac,
            mixed_precision=p.mixed_precision,
            cpu_offload=p.cpu_offload,
            optimizer=cfg.optim.name,
            optimizer_offload=cfg.optim.offload,
            prefetch=p.prefetch,
            strategy=p.strategy,
            device=device,
            name=cfg.model.name,
            grad_accum=cfg.train.grad_accum,
            accumulation=cfg.train.accumulation,
            replicate_adapters=cfg.lora.replicate_adapters,
            **lora,
        )
    except Exception as e:
        return f"memory plan unavailable: {type(e).__name__}: {e}"


def device_memory(device: torch.device) -> str:
    """The memory a rank's peak is to fit in, in words."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return f"{fmt_bytes(total)} on {torch.cuda.get_device_name(device)}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return f"host memory {fmt_bytes(host)}" + (f" shared by {local} ranks" if local > 1 else "")


# torchao's low-bit states are block-wise quantized (fsdp2kit/optim.py); the others follow the parameters.
_STATES = {"adamw8bit": "8-bit", "adamw4bit": "4-bit", "adamw_fp8": "float8"}


def optimizer_state_dtype(cfg: Config, plan: fk.ShardPlan) -> str:
    """The optimizer state's dtype: the ShardPlan's (torch AdamW: like the parameters) or torchao's blocks."""
    return f"{_STATES[cfg.optim.name]} blocks" if cfg.optim.name in _STATES else plan.state_dtype


def summary(cfg: Config, plan: fk.ShardPlan, memory: MemoryPlan | str, device: torch.device) -> str:
    """The start-up lines (rank 0): what runs where, in which dtypes, whether it should fit, where it writes."""
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape))
    trainable = sum(plan.master_numel.values())
    lora = ""
    if cfg.lora.r:
        lora = f", {'QLoRA' if cfg.lora.qlora else 'LoRA'} r={cfg.lora.r} on {cfg.lora.targets}"
    lines = [
        f"model {cfg.model.name}: {fmt_count(plan.n_params)} parameters ({fmt_count(trainable)} trained{lora}) "
        f"in {len(plan.units)} FSDP units, mesh ({mesh}), {plan.strategy}"
        + (", CPU offload" if plan.cpu_offload else ""),
        f"precision: {plan.precision_line}"
        if cfg.optim.name == "adamw"
        else "precision: "
        + plan.precision_line.replace(
            f"AdamW state {plan.state_dtype}", f"{cfg.optim.name} state {optimizer_state_dtype(cfg, plan)}"
        ),
    ]
    if cfg.parallel.mixed_precision == "pure_bf16" and cfg.optim.name == "adamw":
        lines[-1] += " (round-to-nearest updates: optim.name=adamw_bf16sr rounds them stochastically)"
    if isinstance(memory, MemoryPlan):
        # On CPU the planner predicts live tensor bytes, not the process's RSS (support/metrics.py).
        what = "live tensors" if device.type == "cpu" else "allocated, with the allocator's margin"
        lines.append(
            f"memory: predicted peak {fmt_bytes(memory.peak_bytes)} per rank ({what}, in {memory.phase}) "
            f"vs {device_memory(device)}"
        )
    else:
        lines.append(memory)
    verbose = "" if cfg.log.verbose else "; --log.verbose true prints them"
    log = cfg.log.jsonl
    lines.append(
        f"log: {log} (the full memory plan and ShardPlan are in its start event{verbose})" if log else "log: none"
    )
    ckpt = cfg.checkpoint
    every = f"every {ckpt.every} steps and at the end" if ckpt.every else "at the end"
    lines.append(f"checkpoints: {ckpt.dir} ({every})")
    return "\n".join(lines)
