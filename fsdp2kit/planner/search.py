"""The cheapest change that makes a plan fit: try each knob, keep what fits, rank by its cost in throughput.

How it works and why: docs/internals.md, section fsdp2kit/planner/search.py.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from fsdp2kit.planner.api import Settings, plan_settings
from fsdp2kit.planner.report import MemoryPlan

__all__ = ["cheapest_changes"]


# Context parallelism's total degrees the search tries (one node's 8 GPUs at most).
_CP = (2, 4, 8)


def _candidates(s: Settings, long: bool = False) -> list[tuple[str, float, Settings]]:
    """The single changes to ``s`` with their rough cost; ``long``: activations dominate, so splitting
    the sequence (context parallelism) is worth trying."""
    out: list[tuple[str, float, Settings]] = []
    r = dataclasses.replace
    if s.mixed_precision in (None, "fp32"):
        out.append(("--mixed-precision bf16", 0.0, r(s, mixed_precision="bf16")))
    ac = s.activation_checkpointing
    order = {None: 0, "selective": 1, "full": 3}
    current = order.get(ac, 2) if not isinstance(ac, int) or isinstance(ac, bool) else 2
    if current < 1:
        out.append(("--ac selective", 0.10, r(s, activation_checkpointing="selective")))
    if current < 2:
        out.append(("--ac 2 (every 2nd block)", 0.17, r(s, activation_checkpointing=2)))
    if current < 3:
        out.append(("--ac full", 0.33, r(s, activation_checkpointing="full")))
    if s.optimizer == "adamw":
        out.append(("--optimizer adamw8bit", 0.05, r(s, optimizer="adamw8bit")))
    batch, cost = s.batch, 0.0
    while batch > 1:
        batch, cost = batch // 2, cost + 0.10
        accum = s.grad_accum * s.batch // batch
        out.append((f"--batch {batch} with {accum}x gradient accumulation", cost, r(s, batch=batch, grad_accum=accum)))
    if s.replicate > 1 and s.replicate % 2 == 0:
        out.append(
            (
                f"--replicate {s.replicate // 2} --shard {s.shard * 2} (same GPUs)",
                0.10,
                r(s, replicate=s.replicate // 2, shard=s.shard * 2),
            )
        )
    for cp in (c for c in _CP if long and c > s.cp and c % s.cp == 0):
        k = cp // s.cp
        cost = 0.05 * (1 + k.bit_length() - 1)  # 2x: ~10%, 4x: ~15%, 8x: ~20% (docs/internals.md)
        if s.shard % k == 0:
            # Same GPUs: k times fewer sequences a step, k times the accumulation keeps the global batch.
            shard, accum = s.shard // k, s.grad_accum * k
            label = f"--cp {cp} --shard {shard}, {accum}x gradient accumulation (recipe: --parallel.cp {cp})"
            out.append((label, cost, r(s, cp=cp, shard=shard, grad_accum=accum)))
        else:
            out.append((f"--cp {cp} ({k}x the GPUs; recipe: --parallel.cp {cp})", 0.6 + 0.05 * k, r(s, cp=cp)))
    if not s.cpu_offload:
        out.append(("--cpu-offload", 0.50, r(s, cpu_offload=True)))
    for k in (2, 4):
        out.append((f"--shard {s.shard * k} ({k}x the GPUs)", 0.6 + 0.05 * k, r(s, shard=s.shard * k)))
    if s.lora is None:
        out.append(("--lora 16 (train adapters, not the model)", 1.0, r(s, lora=16)))
        out.append(("--lora 16 --qlora", 1.1, r(s, lora=16, qlora=True)))
    return out


def _plan_or_none(model: nn.Module, s: Settings, cache: dict) -> MemoryPlan | None:
    # A change this model cannot take (QLoRA's NF4 groups not dividing a weight's shard, say)
    # raises the error the real run would: it is not a change to offer.
    try:
        return plan_settings(model, s, cache)
    except ValueError:
        return None


def cheapest_changes(model: nn.Module, s: Settings, gpu_memory: int, *, limit: int = 6) -> list[dict]:
    """Single changes to ``s`` whose plan fits in ``gpu_memory``, cheapest first; pairs of them if none does."""
    cache: dict = {}
    base = _plan_or_none(model, s, cache)
    # A long sequence: what the step saves and the logits outweigh what is held all step.
    long = base is not None and (
        base.saved_activations + base.logits_and_loss > base.param_bytes + base.grad_bytes + base.optimizer_bytes
    )
    tried: list[tuple[str, float, Settings, MemoryPlan]] = []
    for label, cost, settings in _candidates(s, long):
        plan = _plan_or_none(model, settings, cache)
        if plan is not None:
            tried.append((label, cost, settings, plan))
    fits = [t for t in tried if t[3].peak_bytes <= gpu_memory]
    if not fits:
        # No single change: try each change on top of each same-hardware change.
        for label, cost, settings, _ in [t for t in tried if t[1] < 0.6]:
            for label2, cost2, settings2 in _candidates(settings, long):
                if cost2 >= cost or label2.split()[0] == label.split()[0]:
                    continue  # each pair once, and never the same knob twice
                plan = _plan_or_none(model, settings2, cache)
                if plan is not None and plan.peak_bytes <= gpu_memory:
                    fits.append((f"{label} + {label2}", cost + cost2, settings2, plan))
    fits.sort(key=lambda t: (t[1], t[3].peak_bytes))
    return [
        {
            "change": label,
            "cost": _describe(cost),
            "cost_fraction": cost,
            "peak_bytes": plan.peak_bytes,
            "headroom_bytes": gpu_memory - plan.peak_bytes,
        }
        for label, cost, _, plan in fits[:limit]
    ]


def _describe(cost: float) -> str:
    if cost == 0:
        return "none (faster)"
    if cost >= 1.0:
        return "changes what is trained"
    if cost >= 0.6:
        return "more GPUs"
    return f"~{cost:.0%} slower"


def rank_by_step_time(
    model: nn.Module, s: Settings, changes: list[dict], hardware, *, nodes: int = 1, baseline=None
) -> list[dict]:
    """``changes`` (what `cheapest_changes` returned for ``s``) ranked by their predicted step time on
    ``hardware`` (`fsdp2kit.planner.steptime`, on ``nodes`` nodes, more for a change that adds GPUs) in place
    of the fixed guesses; changes to what is trained (LoRA) still come last, and CPU offload (whose
    transfers the model leaves out) after the changes timed in full. Each gets ``step_seconds`` and
    ``tokens_per_second_per_gpu``, and its ``cost`` says them (against ``baseline``, the unchanged settings'
    `StepTime`, when given). A change whose settings cannot be rebuilt from its label keeps its place, last."""
    import math

    from fsdp2kit.planner.steptime import predict_step

    cache: dict = {}
    ranked, unranked = [], []
    for change in changes:
        settings = _settings_of(s, change["change"])
        step = None
        if settings is not None:
            world = settings.replicate * settings.shard * getattr(settings, "cp", 1) * settings.tp
            n = max(nodes, math.ceil(world / hardware.gpus_per_node))
            try:
                step = predict_step(model, settings, hardware, nodes=n, cache=cache)
            except ValueError:  # a world that does not split over whole nodes
                step = None
        if step is None:
            unranked.append(change)
            continue
        what = f"step {step.step_s:.2f} s, {step.tokens_per_second_per_gpu:,.0f} tok/s/GPU"
        if baseline is not None:
            what += f" ({step.tokens_per_second_per_gpu / baseline.tokens_per_second_per_gpu - 1:+.0%})"
        # CPU offload's host transfers and CPU optimizer step are not in the model: its time is a lower
        # bound, so it is ranked after the changes whose time is whole.
        partial = settings.cpu_offload and not s.cpu_offload
        if partial:
            what += " at best (offload's transfers not modelled)"
        if change["cost_fraction"] >= 1.0:
            what += ", changes what is trained"
        timed = {
            **change,
            "cost": what,
            "step_seconds": step.step_s,
            "tokens_per_second_per_gpu": step.tokens_per_second_per_gpu,
        }
        ranked.append((change["cost_fraction"] >= 1.0, partial, step.step_s, len(ranked), timed))
    ranked.sort(key=lambda t: t[:4])
    return [t[4] for t in ranked] + unranked


def _settings_of(s: Settings, label: str) -> Settings | None:
    """The settings a change's label stands for: each ``" + "``-joined part a candidate label of the last."""
    # The candidate generator by whichever name this module gives it (private here; public where the
    # optimizer planner's search exports it), so the ranking follows the search it ranks.
    generate = globals().get("candidates") or globals()["_candidates"]
    for part in label.split(" + "):
        s = {lab: new for lab, _, new in generate(s)}.get(part)
        if s is None:
            return None
    return s
