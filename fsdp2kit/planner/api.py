"""plan_memory: the predicted per-rank peak of one training step, before any GPU is rented."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from fsdp2kit.accumulation import check_accumulation
from fsdp2kit.models import max_positions
from fsdp2kit.parallel.context_parallel import RING_CUDA_ONLY, RING_PACKED, STYLES, check_heads, check_ring_seq
from fsdp2kit.parallel.cp_inputs import check_seq
from fsdp2kit.plan import ShardPlan
from fsdp2kit.planner.adapt import lora_model, trained_model
from fsdp2kit.planner.held import micro_batch_units
from fsdp2kit.planner.parts import OPTIMIZERS, margin_bytes, optimizer_bytes, rank_shards, units_for
from fsdp2kit.planner.report import PART_NAMES, MemoryPlan
from fsdp2kit.planner.timeline import replay
from fsdp2kit.planner.trace import block_names, record_step
from fsdp2kit.precision import resolve_precision
from fsdp2kit.shard import estimate_plan
from fsdp2kit.weights.adapters import is_peft_model
from fsdp2kit.wrappers.activation import resolve_ac_mode

__all__ = ["Settings", "check_cp_heads", "check_lora", "plan_memory", "plan_settings", "plan_shards", "trained_plan"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a plan depends on besides the model (what the cheapest-change search varies)."""

    shard: int
    batch: int
    seq: int
    replicate: int = 1
    tp: int = 1
    activation_checkpointing: str | int | None = None
    mixed_precision: str | None = None
    optimizer: str = "adamw"
    cpu_offload: bool = False
    prefetch: int = 1
    strategy: str | None = None
    device: str = "cuda"
    optimizer_impl: str | None = None
    lora: int | None = None
    qlora: bool = False
    lora_targets: str | tuple[str, ...] = "all-linear"  # or module names, as fsdp2kit.apply_lora takes them
    grad_accum: int = 1  # micro-batches a step
    cp: int = 1  # context-parallel ranks a sequence is split over; FSDP shards over shard x cp
    cp_style: str = "all_to_all"  # fsdp2kit.apply_context_parallel's style: "all_to_all" (Ulysses) or "ring"
    packed: bool = False  # rows of several documents: under cp, a document mask (seq x seq a row)
    optimizer_offload: bool = False  # optimizer state (and its step) in host memory; parameters stay on the device
    accumulation: str = "regather"  # how the micro-batches communicate (fsdp2kit.accumulate): what they hold
    replicate_adapters: bool = False  # LoRA: trainable parameters whole on every rank (shard_model's option)

    def check(self) -> None:
        for name in ("shard", "replicate", "tp", "cp", "batch", "seq", "grad_accum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected a positive int")
        check_seq(f"context parallelism: seq={self.seq}", self.seq, self.cp)
        check_cp_style(self.cp_style)
        if self.cp > 1 and self.cp_style == "ring":  # what apply_context_parallel's ring refuses, in its words
            if self.device == "cpu":
                raise ValueError(RING_CUDA_ONLY)
            if self.packed:
                raise ValueError(RING_PACKED)
            check_ring_seq(self.seq, self.cp)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch!r}: expected an int >= 0 (0: FSDP2's implicit prefetch)")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: expected 'cuda' or 'cpu'")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: expected one of {list(OPTIMIZERS)}")
        if self.optimizer_impl not in (None, "foreach", "for-loop", "fused"):
            raise ValueError(f"optimizer_impl={self.optimizer_impl!r}: expected 'foreach', 'for-loop' or 'fused'")
        if self.optimizer == "adamw_bf16sr" and self.mixed_precision != "pure_bf16":
            # as make_optimizer refuses it: the plan of a run that cannot start is no plan
            raise ValueError("optimizer='adamw_bf16sr' steps bf16 parameters: it needs mixed_precision='pure_bf16'")
        if self.activation_checkpointing is not None and not callable(self.activation_checkpointing):
            resolve_ac_mode(self.activation_checkpointing)
        if self.optimizer_offload and self.cpu_offload:
            raise ValueError(
                "optimizer_offload with cpu_offload: cpu_offload already keeps the optimizer state on the host"
            )
        if self.optimizer_offload and self.optimizer != "adamw":
            # as make_optimizer(offload=True): a low-bit state is already small, plain SGD keeps none
            raise ValueError(f"optimizer_offload is for optimizer='adamw' (not {self.optimizer!r})")
        resolve_precision(self.mixed_precision)
        check_accumulation(self.accumulation, hsdp=self.replicate > 1)
        check_lora(self.lora, self.qlora, self.lora_targets, self.tp)


def check_cp_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"cp_style={style!r}: expected one of {STYLES}")


def check_cp_heads(model: nn.Module, cp: int, tp: int = 1, style: str = "all_to_all") -> None:
    """`fsdp2kit.apply_context_parallel`'s heads check on the model's config (one TP rank's heads); without a
    config, the trace checks them; the ring splits no heads."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if cp == 1 or style == "ring" or not isinstance(heads, int):
        return
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    check_heads(cp, heads // tp, kv_heads // tp, tp)


def check_lora(lora: int | None, qlora: bool, targets: str | tuple[str, ...], tp: int) -> None:
    """The LoRA settings the planner can build (`fsdp2kit.planner.adapt.lora_model`), or ``ValueError``."""
    if lora is not None and (isinstance(lora, bool) or not isinstance(lora, int) or lora < 1):
        raise ValueError(f"lora={lora!r}: expected the LoRA rank, a positive int")
    if qlora and lora is None:
        raise ValueError("qlora=True needs a LoRA rank (lora=R): QLoRA trains LoRA adapters over NF4 weights")
    if targets != "all-linear":
        if not isinstance(targets, tuple) or not targets or not all(isinstance(n, str) and n for n in targets):
            raise ValueError(f"lora_targets={targets!r}: expected 'all-linear' or a tuple of module names")
        if lora is None:
            raise ValueError(f"lora_targets={list(targets)} needs a LoRA rank (lora=R): they say where adapters go")
    if lora is not None and tp > 1:
        raise ValueError(
            f"lora={lora} with tp={tp}: the planner does not model LoRA adapters under tensor "
            "parallelism (plan them apart: tp=1 with LoRA, or tp without)"
        )


def plan_shards(
    model: nn.Module,
    *,
    shard: int,
    cp: int = 1,
    cp_style: str = "all_to_all",
    lora: int | None = None,
    qlora: bool = False,
    lora_targets: str | tuple[str, ...] = "all-linear",
    **plan_args: Any,
) -> ShardPlan:
    """`fsdp2kit.estimate_plan` (``plan_args``: its other arguments, ``replicate``, ``tp``, ``mixed_precision``, ...)
    of ``model`` with ``lora`` adapters as `plan_memory` puts them (the two plans count one model), over a
    ``shard * cp`` shard group (the context-parallel ranks share the parameter shards)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r}: expected a positive int")
    check_cp_style(cp_style)
    tp = plan_args.get("tp", 1)
    check_lora(lora, qlora, lora_targets, tp)
    check_cp_heads(model, cp, tp, cp_style)
    if lora is not None:
        compute = resolve_precision(plan_args.get("mixed_precision")).compute_dtype
        model = lora_model(model, r=lora, qlora=qlora, targets=lora_targets, compute_dtype=compute)
    return estimate_plan(model, shard=shard * cp, **plan_args)


def plan_memory(
    model: nn.Module,
    *,
    shard: int,
    batch: int,
    seq: int,
    replicate: int = 1,
    tp: int = 1,
    cp: int = 1,
    cp_style: str = "all_to_all",
    packed: bool = False,
    activation_checkpointing: str | int | None = None,
    mixed_precision: str | None = None,
    optimizer: str = "adamw",
    cpu_offload: bool = False,
    optimizer_offload: bool = False,
    prefetch: int = 1,
    strategy: str | None = None,
    device: str = "cuda",
    optimizer_impl: str | None = None,
    lora: int | None = None,
    qlora: bool = False,
    lora_targets: str | Sequence[str] = "all-linear",
    gpu_memory: int | None = None,
    name: str = "",
    grad_accum: int = 1,
    accumulation: str = "regather",
    replicate_adapters: bool = False,
) -> MemoryPlan:
    """Predict the per-rank peak memory of one steady-state training step, its parts, and when it happens.

    ``model`` is built on the meta device (or is a real model: nothing is allocated either way,
    nothing is changed). ``batch`` is the micro-batch per data-parallel rank, ``seq`` the tokens
    per sample (the whole sequence: with ``cp`` each rank holds ``seq / cp`` of them). The step is
    the recipe's: forward, logits upcast to fp32 for cross entropy, backward, optimizer step, with
    the optimizer state present from the previous step. How: docs/memory_planner.md.
    ``device="cuda"`` adds an allocator margin and uses the ``foreach`` AdamW step (CUDA's default);
    ``device="cpu"`` gives live tensor bytes with CPU's per-tensor step (what the CPU check measures).

    Args:
        shard, replicate: the (replicate, shard) mesh, as for `fsdp2kit.make_mesh`.
        tp: tensor-parallel degree: the model's own plan, traced on one TP rank's slices.
        cp: context-parallel degree (`fsdp2kit.apply_context_parallel`): parameters, gradients and optimizer
            state sharded over ``shard * cp`` ranks; ``cp`` divides ``seq`` (and, all-to-all, the heads).
        cp_style: ``"all_to_all"`` or ``"ring"`` (CUDA; torch's ring, its buffers as torch allocates them:
            planner/trace.py); each refused where `fsdp2kit.apply_context_parallel` refuses it.
        packed: rows hold several documents: under ``cp`` the attention gets a document mask.
        activation_checkpointing: None, ``"full"``, ``"selective"``, ``"op"`` or N, as
            `fsdp2kit.apply_activation_checkpointing` does them; or a function ``apply(model)`` that
            checkpoints the model its own way (another trainer's policy), called on the planner's copy.
        mixed_precision: as `fsdp2kit.shard_model` takes it; ``plan.config`` names the master and
            optimizer-state dtypes that follow.
        optimizer: a `make_optimizer` name or ``"sgd"`` (no momentum).
        cpu_offload: sharded parameters, gradients and optimizer state live in host memory.
        optimizer_offload: only the optimizer state and its step live on the host
            (``make_optimizer(..., offload=True)``); ``host_bytes`` adds a host copy of the sharded
            parameters and gradients, which the host step reads and writes.
        prefetch: explicit prefetch depth (`fsdp2kit.set_prefetch`); 0 is FSDP2's implicit one.
        lora, qlora, lora_targets: train rank-``lora`` peft adapters as the recipe's ``[lora]`` table does
            (docs/memory_planner.md, "Tensor parallelism, LoRA, QLoRA"). A model that is already a peft
            model is planned as it is (leave these unset).
        gpu_memory: bytes per device; the plan then says whether it fits and by how much.
        grad_accum, accumulation: micro-batches a step and the `fsdp2kit.accumulate` policy they run
            under; the peak adds what the policy holds between them (docs/accumulation.md, "Memory").
        replicate_adapters: the trainable parameters (LoRA adapters) whole on every rank, with their
            gradients and optimizer state, as `fsdp2kit.shard_model(..., replicate_adapters=True)` keeps them.

    A ``seq`` longer than the model's ``max_position_embeddings`` is planned, with a note saying so.
    """
    targets = (lora_targets,) if isinstance(lora_targets, str) else tuple(lora_targets)
    lora_targets = "all-linear" if targets == ("all-linear",) else targets
    args = locals()  # every Settings field is an argument of the same name
    settings = Settings(**{f.name: args[f.name] for f in dataclasses.fields(Settings)})
    plan = plan_settings(model, settings, cache={})
    plan.gpu_memory = gpu_memory
    plan.config["model"] = name or type(model).__name__
    return plan


def trained_plan(model: nn.Module, s: Settings, cache: dict) -> tuple[nn.Module, ShardPlan]:
    """``model`` as the run trains it (`fsdp2kit.planner.adapt`: LoRA/QLoRA adapters, then one TP rank's slices;
    kept in ``cache`` for the search) and its `ShardPlan`, for settings ``s`` (checked here)."""
    s.check()
    prec = resolve_precision(s.mixed_precision)
    if is_peft_model(model):
        if s.lora is not None:
            raise ValueError(
                f"lora={s.lora}: the model is a peft model already; its own adapters are planned (leave lora unset)"
            )
        if s.tp > 1:
            raise ValueError(
                f"a peft model with tp={s.tp}: the planner does not model LoRA adapters under tensor parallelism"
            )
    if s.lora is not None or s.tp > 1:
        key = ("as trained", id(model), s.lora, s.qlora, s.lora_targets, s.tp, prec.compute_dtype)
        if key not in cache:
            work = trained_model(
                model, lora=s.lora, qlora=s.qlora, targets=s.lora_targets, tp=s.tp, compute_dtype=prec.compute_dtype
            )
            cache[key] = (model, work)  # the model too: its id must not be reused while the key lives
        model = cache[key][1]
    check_cp_heads(model, s.cp, s.tp, s.cp_style)
    plan = estimate_plan(
        model,
        shard=s.shard * s.cp,  # the context-parallel ranks share the parameter shards
        replicate=s.replicate,
        strategy=s.strategy,
        mixed_precision=prec,
        cpu_offload=s.cpu_offload,
        replicate_adapters=s.replicate_adapters,  # refused with cpu_offload here, for predict_step(memory_plan=...) too
    )
    return model, plan


def plan_settings(model: nn.Module, s: Settings, cache: dict) -> MemoryPlan:
    """`plan_memory` for a `Settings`; ``cache`` keeps recordings between calls that share batch, seq, AC and dtype."""
    model, plan = trained_plan(model, s, cache)
    kept = frozenset(id(p) for p in model.parameters() if p.requires_grad) if s.replicate_adapters else frozenset()
    prec = plan.precision
    compute = prec.compute_dtype
    shard_size = plan.mesh_shape[-1]
    unit_names = [list(u.modules) for u in plan.units]
    blocks = block_names(model)
    # Replicated adapters are outside FSDP's mixed-precision cast: they compute in their own dtype (fp32).
    key = (id(model), s.batch, s.seq, s.cp, s.cp_style, s.activation_checkpointing, compute, bool(kept))
    if key not in cache:
        cache[key] = record_step(
            model,
            unit_names,
            batch=s.batch,
            seq=s.seq // s.cp,  # this rank's tokens; attention sees all of them (trace.py)
            compute_dtype=compute,
            activation_checkpointing=s.activation_checkpointing,
            cp=s.cp,
            cp_style=s.cp_style,
            own_dtype=kept,
        )
    units = units_for(model, plan, replicated=kept)
    position = {n: i for i, (n, _) in enumerate(model.named_modules())}  # the final callback's order: root first
    final_order = sorted((n[0] for n in unit_names), key=lambda n: position.get(n, len(position)))

    # Each trainable parameter as a rank holds it (whole when replicated), and the replicated gradients' flat
    # copy, all-reduced at the end of the (last) backward (fsdp2kit/replicated.py).
    shards = rank_shards(model, 1 if kept else shard_size, prec)
    trainable = sum(n * dt.itemsize for n, dt, _ in shards)
    flat = trainable if kept else 0

    def run(us, rec=cache[key], flat=flat):
        return replay(
            rec,
            us,
            unit_names,
            blocks,
            world=shard_size,
            prefetch=s.prefetch,
            clone_reduce_input=s.device == "cpu" and shard_size > 1,  # gloo's reduce-scatter clones it (timeline.py)
            final_order=final_order,
            final_transient=flat,
        )

    step = run(units)
    if s.grad_accum > 1:  # the micro-batch that peaks, with what the policy holds through it
        rdt, pdt = prec.policy.reduce_dtype, prec.policy.param_dtype
        scale = rdt.itemsize / pdt.itemsize if rdt is not None and pdt is not None else 1.0
        rec = cache[key]
        summed = dataclasses.replace(rec, events=[(*e[:2], 0) if e[0] == "grad" else e for e in rec.events])
        micro = []
        variants = micro_batch_units(units, s.accumulation, s.grad_accum, scale, bool(kept))
        for i, (us, extra, in_place) in enumerate(variants):
            r, held = run(us, summed if in_place else rec, flat if i == len(variants) - 1 else 0), sum(extra.values())
            parts = {k: v + extra.get(k, 0) for k, v in r.parts.items()}
            peaks = {k: getattr(r, k) + held for k in ("peak", "forward_peak", "backward_peak")}
            micro.append(peaks | {"phase": r.phase, "parts": parts})
        top = max(micro, key=lambda m: m["peak"])  # its phase and parts; the forward and backward peaks of all
        top |= {k: max(m[k] for m in micro) for k in ("forward_peak", "backward_peak")}
        step = dataclasses.replace(step, **top)

    params = plan.param_bytes_per_rank
    impl = s.optimizer_impl or ("foreach" if s.device == "cuda" else "for-loop")
    opt = optimizer_bytes(shards, s.optimizer, implementation=impl)
    grads = step.grads_sharded

    # Packed rows under cp: the document mask the layers share, saved for backward (parallel/context_parallel.py);
    # the trace runs without it. Checkpointed layers build it again in their recompute: counted at the peak all
    # the same (an upper bound, +1.4% measured with full AC)
    mask = s.batch * s.seq**2 * (compute or next(model.parameters()).dtype).itemsize if s.packed and s.cp > 1 else 0
    step_parts = {k: step.parts.get(k, 0) for k in PART_NAMES if k != "margin"}
    step_parts.update(params=params, optimizer=opt.state, activations=step_parts["activations"] + mask)
    opt_parts = dict.fromkeys(step_parts, 0)
    opt_parts.update(params=params, grads=grads, optimizer=opt.state, temporaries=opt.temporaries)
    host = 0
    if s.cpu_offload:
        # Sharded parameters, gradients and optimizer state live on the host; the step runs there.
        host = step_parts["params"] + grads + step_parts["optimizer"]
        step_parts.update(params=0, grads=0, optimizer=0)
        opt_parts = dict.fromkeys(opt_parts, 0)  # the step's parts all on the host
    elif s.optimizer_offload:
        # The state and its step on the host: the device keeps parameters and gradients, and sends the
        # trainable parameters and their gradients to (and takes the updated parameters from) a host copy of both.
        host = step_parts["optimizer"] + trainable + grads
        step_parts["optimizer"] = opt_parts["optimizer"] = opt_parts["temporaries"] = 0
    step_peak, opt_peak = sum(step_parts.values()), sum(opt_parts.values())
    if opt_peak > step_peak:
        parts, phase, live = opt_parts, "optimizer step", opt_peak
    else:
        parts, phase, live = step_parts, step.phase, step_peak
    margin = margin_bytes(live, s.device)
    parts = {**parts, "margin": margin}
    state = step_parts["params"] + step_parts["optimizer"]
    # The optimizer state's dtype, as `optimizer_bytes` counts it.
    state_dtype = plan.master_dtype if s.optimizer in ("adamw", "adamw_bf16sr") else "none"
    low_bit = {"adamw8bit": "int8", "adamw4bit": "4-bit", "adamw_fp8": "float8_e4m3fn"}.get(s.optimizer)
    if low_bit is not None:
        state_dtype = f"{low_bit} (fp32 scales; tensors under 4096 elements: {plan.master_dtype})"
    config: dict[str, Any] = dataclasses.asdict(s) | {
        "strategy": plan.strategy,
        "peft": is_peft_model(model),  # a model with its own adapters (the recipe's [lora] table)
        "master_dtype": plan.master_dtype,
        "state_dtype": state_dtype,
    }
    notes = []
    limit = max_positions(model)
    if limit is not None and s.seq > limit:
        notes.append(
            f"seq {s.seq} exceeds the model's max_position_embeddings {limit} (a pretrained model never saw later "
            "positions); the recipe refuses it unless [model] max_position_embeddings raises the limit"
        )
    if s.cp > 1:
        how = (
            f"attention runs over all {s.seq} for 1/{s.cp} of the heads"
            if s.cp_style == "all_to_all"
            else f"k and v go round the {s.cp} ranks (torch's ring, its default all-gather rotation)"
        )
        notes.append(
            f"context parallelism cp={s.cp} ({s.cp_style.replace('_', '-')} style): each rank holds "
            f"{s.seq // s.cp} tokens of every sequence; {how}; parameters, gradients and "
            f"optimizer state are sharded over shard x cp = {s.shard * s.cp} ranks"
        )
    if s.optimizer not in ("adamw", "sgd", "adamw_bf16sr") and s.device == "cuda":
        notes.append(f"{s.optimizer}'s step temporaries are as measured with inductor's CPU kernels")
    return MemoryPlan(
        notes=notes,
        config=config,
        peak_bytes=live + margin,
        phase=phase,
        parts=parts,
        saved_activations=step.saved_activations + (0 if s.activation_checkpointing else mask),
        activations_per_block=max(step.saved_by_block, default=0),
        logits_and_loss=step.logits_and_loss,
        forward_peak=state + step.forward_peak + mask,
        backward_peak=state + step.backward_peak + mask,
        optimizer_peak=opt_peak,
        host_bytes=host,
        param_bytes=params,
        grad_bytes=grads,
        optimizer_bytes=opt.state,
        trainable_param_bytes=trainable,
        measured_like={"max_gathered": step.max_gathered, "max_comm_buffers": step.max_buffers, "grads": grads},
    )
