"""The cheapest change that makes a plan fit, each knob ranked by its cost (docs/internals.md, planner/search.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch.nn as nn

from fsdp2kit.accumulation import _HSDP_ONLY, ACCUMULATION
from fsdp2kit.planner.api import Settings, plan_settings
from fsdp2kit.planner.comm import _counts, comm_of_settings
from fsdp2kit.planner.report import MemoryPlan

__all__ = ["all_changes", "candidates", "cheapest_changes", "pick_accumulation", "recipe_flags"]

# torchao's low-bit AdamW states, by the cost the search ranks them at (see docs/internals.md).
_LOW_BIT = {"adamw8bit": 0.05, "adamw_fp8": 0.06, "adamw4bit": 0.08}
_PURE_BF16 = 0.04

# The recipe option (recipes/support/options.py, `--table.key value`) behind each Settings field a change can move.
RECIPE_OPTIONS = {
    "shard": "parallel.shard",
    "replicate": "parallel.replicate",
    "batch": "data.batch_size",
    "grad_accum": "train.grad_accum",
    "activation_checkpointing": "parallel.activation_checkpointing",
    "mixed_precision": "parallel.mixed_precision",
    "optimizer": "optim.name",
    "optimizer_offload": "optim.offload",
    "cpu_offload": "parallel.cpu_offload",
    "cp": "parallel.cp",
    "packed": "data.packing",
    "lora": "lora.r",
    "qlora": "lora.qlora",
    "accumulation": "train.accumulation",
    "replicate_adapters": "lora.replicate_adapters",
}


def recipe_flags(base: Settings, changed: Settings) -> list[str]:
    """The recipe's command-line options that turn a run configured as ``base`` into ``changed``."""
    out = []
    for f in dataclasses.fields(changed):
        old, new = getattr(base, f.name), getattr(changed, f.name)
        if old == new:
            continue
        if f.name not in RECIPE_OPTIONS or new is None:
            raise ValueError(f"{f.name}={new!r}: no recipe option sets it")
        out += [f"--{RECIPE_OPTIONS[f.name]}", str(new).lower() if isinstance(new, bool) else str(new)]
    return out


def candidates(s: Settings, long: bool = False) -> list[tuple[str, float, Settings]]:
    """Every single change the search tries from ``s``: (label in `fsdp2kit plan` flags, cost, settings);
    ``long``: activations dominate, so splitting the sequence (context parallelism) is worth trying."""
    out: list[tuple[str, float, Settings]] = []
    r = dataclasses.replace
    if s.mixed_precision in (None, "fp32"):
        out.append(("--mixed-precision bf16", 0.0, r(s, mixed_precision="bf16")))
    if s.mixed_precision != "pure_bf16" and s.lora is None and not s.optimizer_offload:
        # bf16 weights, gradients and state; its optimizer rounds stochastically (make_optimizer):
        # plain AdamW becomes torchao's AdamW with bf16 stochastic rounding, a low-bit one stays.
        if s.optimizer == "adamw":
            label, pure = "--mixed-precision pure_bf16 --optimizer adamw_bf16sr", r(s, optimizer="adamw_bf16sr")
            out.append((label, _PURE_BF16, r(pure, mixed_precision="pure_bf16")))
        elif s.optimizer in _LOW_BIT:
            out.append(("--mixed-precision pure_bf16", _PURE_BF16, r(s, mixed_precision="pure_bf16")))
    # Each AC mode that saves less than the current one (an int or a function ranks as "every 2nd").
    order = {None: 0, "selective": 1, "op": 1.5, "full": 3}
    more_ac = (("selective", "", 0.10), ("op", " (torchtitan's per-op)", 0.15), (2, " (every 2nd block)", 0.17))
    for ac, why, cost in (*more_ac, ("full", "", 0.33)):
        if order.get(s.activation_checkpointing, 2) < order.get(ac, 2):
            out.append((f"--ac {ac}{why}", cost, r(s, activation_checkpointing=ac)))
    if s.optimizer in ("adamw", "adamw_bf16sr") and not s.optimizer_offload:
        out += [(f"--optimizer {name}", cost, r(s, optimizer=name)) for name, cost in _LOW_BIT.items()]
    # State offload is for fp32 AdamW state (recipes/support/options.py): a low-bit state is already small.
    if not s.optimizer_offload and not s.cpu_offload and s.optimizer == "adamw":
        out.append(("--optimizer-offload", 0.25, r(s, optimizer_offload=True)))
    if s.grad_accum > 1:
        # Another accumulation policy: free where it sends no more of any collective, else a guess.
        now = _counts(s.accumulation, s.grad_accum)
        for policy in _policies(s):
            if policy != s.accumulation:
                fewer = all(a <= b for a, b in zip(_counts(policy, s.grad_accum), now))
                out.append((f"--accumulation {policy}", 0.0 if fewer else 0.05, r(s, accumulation=policy)))
    batch, cost = s.batch, 0.0
    while batch > 1:
        batch, cost = batch // 2, cost + 0.10
        accum = s.grad_accum * s.batch // batch
        out.append((f"--batch {batch} with {accum}x gradient accumulation", cost, r(s, batch=batch, grad_accum=accum)))
    if s.replicate > 1 and s.replicate % 2 == 0:
        replicate, shard = s.replicate // 2, s.shard * 2
        label = f"--replicate {replicate} --shard {shard} (same GPUs)"
        out.append((label, 0.10, r(s, replicate=replicate, shard=shard)))
    # Context parallelism's total degrees (one node's 8 GPUs at most).
    for cp in (c for c in (2, 4, 8) if long and c > s.cp and c % s.cp == 0):
        k = cp // s.cp
        cost = 0.05 * k.bit_length()  # 2x: ~10%, 4x: ~15%, 8x: ~20% (docs/internals.md)
        if s.shard % k == 0:
            # Same GPUs: k times fewer sequences a step, k times the accumulation keeps the global batch.
            shard, accum = s.shard // k, s.grad_accum * k
            label = f"--cp {cp} --shard {shard} with {accum}x gradient accumulation"
            out.append((label, cost, r(s, cp=cp, shard=shard, grad_accum=accum)))
        else:
            out.append((f"--cp {cp} ({k}x the GPUs)", 0.6 + 0.05 * k, r(s, cp=cp)))
    if not s.cpu_offload:
        # it offloads the optimizer state too
        out.append(("--cpu-offload", 0.50, r(s, cpu_offload=True, optimizer_offload=False)))
    out += [(f"--shard {s.shard * k} ({k}x the GPUs)", 0.6 + 0.05 * k, r(s, shard=s.shard * k)) for k in (2, 4)]
    if s.lora is None:
        out.append(("--lora 16 (train adapters, not the model)", 1.0, r(s, lora=16)))
        out.append(("--lora 16 --qlora", 1.1, r(s, lora=16, qlora=True)))
    return out


def _policies(s: Settings) -> list[str]:
    return [p for p in ACCUMULATION if s.replicate > 1 or p not in _HSDP_ONLY]


def pick_accumulation(
    model: nn.Module, s: Settings, gpu_memory: int | None, cache: dict | None = None
) -> tuple[Settings, MemoryPlan, list[dict]]:
    """``(settings, plan, a row per policy)`` of the policy with the fewest collective bytes whose peak fits
    ``gpu_memory``; the lowest peak when none fits or without a budget (every policy would "fit")."""
    cache = {} if cache is None else cache
    tried = []
    for policy in _policies(s):
        t = dataclasses.replace(s, accumulation=policy)
        tried.append((t, plan_settings(model, t, cache), comm_of_settings(model, t, cache=cache).bytes_per_step))
    fits = [x for x in tried if gpu_memory is None or x[1].peak_bytes <= gpu_memory]
    if fits and gpu_memory is not None:
        settings, plan, _ = min(fits, key=lambda x: (x[2], x[1].peak_bytes))
    else:
        settings, plan, _ = min(tried, key=lambda x: (x[1].peak_bytes, x[2]))
    fit = {x[0] for x in fits}
    rows = [
        {"policy": t.accumulation, "peak_bytes": p.peak_bytes, "comm_bytes_per_step": n, "fits": t in fit}
        for t, p, n in tried
    ]
    return settings, plan, rows


def _pairs(singles: list[tuple[str, float, Settings]], long: bool = False) -> list[tuple[str, float, Settings]]:
    """Each change on top of each same-hardware change: each pair once, never the same knob twice."""
    out = []
    for label, cost, settings in singles:
        if cost >= 0.6:
            continue
        for label2, cost2, settings2 in candidates(settings, long):
            if cost2 < cost and label2.split()[0] != label.split()[0]:
                out.append((f"{label} + {label2}", cost + cost2, settings2))
    return out


def all_changes(s: Settings) -> list[tuple[str, float, Settings]]:
    """Every change the search can print for ``s``, single and paired (whether it fits or not)."""
    singles = candidates(s, long=True)
    return singles + _pairs(singles, long=True)


def _plan_or_none(model: nn.Module, s: Settings, cache: dict) -> MemoryPlan | None:
    # A change this model cannot take (QLoRA's NF4 groups not dividing a weight's shard, say)
    # raises the error the real run would: it is not a change to offer.
    try:
        return plan_settings(model, s, cache)
    except ValueError:
        return None


def cheapest_changes(model: nn.Module, s: Settings, gpu_memory: int, *, limit: int = 6) -> list[dict]:
    """Single changes to ``s`` that fit in ``gpu_memory``, and pairs cheaper than the cheapest single one that fits;
    cheapest first, each with its cost, peak and ``recipe`` (the recipe options that make it)."""
    cache: dict = {}
    base = _plan_or_none(model, s, cache)
    # A long sequence: what the step saves and the logits outweigh what is held all step.
    long = base is not None and (
        base.saved_activations + base.logits_and_loss > base.param_bytes + base.grad_bytes + base.optimizer_bytes
    )
    planned = [(label, cost, t, _plan_or_none(model, t, cache)) for label, cost, t in candidates(s, long)]
    tried = [t for t in planned if t[3] is not None]
    fits = [t for t in tried if t[3].peak_bytes <= gpu_memory]
    # Two changes on the same hardware, where they can cost less than the cheapest single change that
    # fits (a smaller optimizer state and bf16 weights rather than CPU offload, say).
    best = min((t[1] for t in fits), default=float("inf"))
    seen: set[Settings] = {t[2] for t in tried}
    for label, cost, settings in _pairs([t[:3] for t in tried], long):
        if cost >= best or settings in seen:
            continue
        seen.add(settings)
        plan = _plan_or_none(model, settings, cache)
        if plan is not None and plan.peak_bytes <= gpu_memory:
            fits.append((label, cost, settings, plan))
    fits.sort(key=lambda t: (t[1], t[3].peak_bytes))
    return [
        {
            "change": label,
            "recipe": " ".join(recipe_flags(s, settings)),
            "cost": _describe(cost),
            "cost_fraction": cost,
            "peak_bytes": plan.peak_bytes,
            "headroom_bytes": gpu_memory - plan.peak_bytes,
        }
        for label, cost, settings, plan in fits[:limit]
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
    """``changes`` (`cheapest_changes`'s) ranked by predicted step time on ``hardware``, LoRA last, then
    one whose settings its label cannot rebuild."""
    from fsdp2kit.planner.steptime import predict_step

    cache: dict = {}
    ranked, unranked = [], []
    by_label = {label: settings for label, _, settings in all_changes(s)}  # every label the search can print
    for change in changes:
        settings = by_label.get(change["change"])
        step = None
        if settings is not None:
            world = settings.replicate * settings.shard * settings.cp * settings.tp
            n = max(nodes, math.ceil(world / hardware.gpus_per_node))
            with contextlib.suppress(ValueError):  # a world that does not split over whole nodes
                step = predict_step(model, settings, hardware, nodes=n, cache=cache)
        if step is None:
            unranked.append(change)
            continue
        tps = step.tokens_per_second_per_gpu
        what = f"step {step.step_s:.2f} s, {tps:,.0f} tok/s/GPU"
        if baseline is not None:
            what += f" ({tps / baseline.tokens_per_second_per_gpu - 1:+.0%})"
        if change["cost_fraction"] >= 1.0:
            what += ", changes what is trained"
        timed = {**change, "cost": what, "step_seconds": step.step_s, "tokens_per_second_per_gpu": tps}
        ranked.append((change["cost_fraction"] >= 1.0, step.step_s, len(ranked), timed))
    ranked.sort(key=lambda t: t[:3])
    return [t[3] for t in ranked] + unranked
