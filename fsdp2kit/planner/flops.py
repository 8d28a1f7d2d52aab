"""Matmul FLOPs of one training step, per FSDP unit: forward, backward, and activation checkpointing's recompute
(what is counted and how: docs/step_time.md, "The model")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp2kit.planner.trace import block_names, on_output_grad, run_step, step_model, unit_modules

__all__ = ["UnitFlops", "count_flops"]

aten = torch.ops.aten
# Fused attention's forward (query, key, value, ...) and backward (grad_out, query, key, value, ...), the CPU
# flash kernel (which the planner's meta step runs, trace.py) among them: the backward's 4 matmuls count twice
# the forward's 2 (torch's formula adds a recompute of the scores).
_KERNELS = ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention")
_ATTENTION_FWD = {getattr(aten, f"_scaled_dot_product_{k}") for k in _KERNELS}
_ATTENTION_BWD = {getattr(aten, f"_scaled_dot_product_{k}_backward") for k in _KERNELS}


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """torch's sdpa_flop_count, with GQA's fewer key/value heads (which torch < 2.13's refuses)."""
    b, h, s_q, d = q.shape
    return 2.0 * b * h * s_q * k.shape[-2] * (d + v.shape[-1])


@dataclass
class UnitFlops:
    """One unit's FLOPs in one micro-batch's step (per rank)."""

    forward: float = 0.0
    backward: float = 0.0  # recompute included
    recompute: float = 0.0  # forward FLOPs run again in backward (activation checkpointing)

    @property
    def model(self) -> float:
        """The FLOPs MFU counts: forward and backward once, no recompute."""
        return self.forward + self.backward - self.recompute


class _Count(TorchDispatchMode):
    def __init__(self, sink) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _ATTENTION_FWD:
            self.sink(_attention(*args[:3]))
        elif packet in _ATTENTION_BWD:
            self.sink(2.0 * _attention(*args[1:4]))
        elif packet in flop_registry:  # torch's formulas: matmuls, float8's _scaled_mm
            self.sink(float(flop_registry[packet](*args, **kwargs, out_val=out)))
        elif packet is aten._grouped_mm:  # MoE experts: with two 2-D operands (a weight gradient) the groups
            a, b = args[:2]  # share out the inner dimension; otherwise each group's rows use it whole
            self.sink(2.0 * (out[0] if a.dim() == 2 and b.dim() == 2 else out).numel() * a.shape[-1])
        elif func.name() == "transformers::grouped_mm_fallback":  # what the planner runs for non-bf16 experts
            self.sink(2.0 * out.numel() * args[0].shape[-1])
        elif func.name() == "transformers::grouped_mm_fallback_backward":  # (input, weight, offs, grad_output)
            self.sink(4.0 * args[3].numel() * args[0].shape[-1])
        return out


def count_flops(
    model: nn.Module,
    unit_names: list[list[str]],
    batch: int,
    seq: int,
    compute_dtype: torch.dtype | None,
    activation_checkpointing: str | int | None,
) -> tuple[list[UnitFlops], list[int]]:
    """`UnitFlops` for each unit of ``unit_names`` in one step of ``batch`` x ``seq`` tokens, and the units' forward
    order, the root first (which unit is charged what: docs/step_time.md, "The model")."""
    # Identical blocks cost identical FLOPs: run the first, one that stands for the middle ones, and the last.
    clone, modules, kept, repeat = step_model(model, compute_dtype, activation_checkpointing, lead=1)

    flops = [UnitFlops() for _ in unit_names]
    stack: list[int] = []
    order: list[int] = []
    state = {"backward": False, "current": len(unit_names) - 1}

    def sink(f: float) -> None:
        i = stack[-1] if stack else state["current"]
        if state["backward"]:
            flops[i].backward += f
            # Autograd runs backward ops with grad mode off; checkpoint's recompute turns it on.
            if torch.is_grad_enabled():
                flops[i].recompute += f
        else:
            flops[i].forward += f

    def unit_hooks(index: int):
        def pre(mod, args, kwargs):
            stack.append(index)
            if index not in order:
                order.append(index)

        def post(mod, args, kwargs, output):
            stack.pop()
            if not state["backward"]:
                on_output_grad(output, lambda grad: state.update(current=index))

        return pre, post

    hooks = [(module, *unit_hooks(i)) for i, _, module in unit_modules(unit_names, modules)]
    run_step(clone, batch, seq, lambda phase: state.update(backward=phase != "forward loss"), hooks, mode=_Count(sink))
    if repeat:
        unit_of = {n: i for i, names in enumerate(unit_names) for n in names}
        stand_in = flops[unit_of[kept[1]]]
        middle = [unit_of[n] for n in block_names(model)[2:-1]]
        for i in middle:
            flops[i] = dataclasses.replace(stand_in)
        at = order.index(unit_of[kept[1]]) + 1
        order[at:at] = middle
    return flops, order
