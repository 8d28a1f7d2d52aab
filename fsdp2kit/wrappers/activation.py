"""Activation checkpointing: full, every N-th block, selective, or torchtitan's op policy (docs/internals.md)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp2kit._internal.markers import CHECKPOINTED
from fsdp2kit.blocks import BlockSpec, find_blocks
from fsdp2kit.wrappers.forward import BlockForward, check_order, current_forward

__all__ = ["SELECTIVE_SAVE", "apply_activation_checkpointing", "op_policy", "resolve_ac_mode"]

AC_MODES = ("full", "selective", "op")


def _ops(names: str, namespace: str = "aten") -> frozenset:
    """The ``.default`` overloads of the ops ``names`` lists, less those this build lacks (e.g. cuDNN attention)."""
    packets = (getattr(getattr(torch.ops, namespace), name, None) for name in names.split())
    return frozenset(p.default for p in packets if p is not None and hasattr(p, "default"))


# The selective policy saves these ops' outputs and recomputes every other op (torch's policy for a list:
# MUST_SAVE these, PREFER_RECOMPUTE the rest, so torch.compile may keep a recomputable tensor that a fused kernel
# produces anyway): matmuls (float8's _scaled_mm too), each backend's fused attention, and max (float8
# scaling's amax: one number to save, a whole tensor to re-read).
SELECTIVE_SAVE: frozenset = _ops(
    "mm addmm bmm baddbmm _scaled_mm max _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention"
    " _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_cudnn_attention"
    " _scaled_dot_product_fused_attention_overrideable"
)


# The "op" policy is torchtitan's per-op selective AC (`_apply_op_sac` with llama3's `_op_sac_save_list`):
# save attention's output and every other matmul's, recompute the rest. Its save list:
# selective's without the batched matmuls, with linear and the math attention, and where this build has them,
# a reduce-scatter's output (tensor parallelism's, not recomputed as a second collective) and FlexAttention.
OP_SAVE: frozenset = (
    (SELECTIVE_SAVE - _ops("bmm baddbmm"))
    | _ops("linear _scaled_dot_product_attention_math")
    | _ops("reduce_scatter_tensor", namespace="_c10d_functional")
    | frozenset(op for op in [getattr(torch._higher_order_ops, "flex_attention", None)] if op is not None)
)

# The matmuls it numbers (forward and recompute apart) to save the odd ones: torchtitan's mm and linear, and
# addmm (a Linear with a bias) and _scaled_mm (a float8 Linear), each one Linear's matmul too.
OP_MATMULS: frozenset = _ops("mm linear addmm _scaled_mm")


def op_policy(counts: dict[str, int]) -> Callable[..., CheckpointPolicy]:
    """The "op" policy for one checkpointed call; ``counts`` numbers its matmuls (fresh per call)."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in OP_MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] = counts.get(key, 0) + 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in OP_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def resolve_ac_mode(mode: str | int) -> tuple[str, int]:
    """``"full"`` -> ("full", 1); ``N`` -> ("every", N); ``"selective"``/``"op"`` -> (that mode, 1)."""
    if isinstance(mode, str) and mode.lower() in AC_MODES:
        return mode.lower(), 1
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise ValueError(f"mode={mode!r}: expected one of {list(AC_MODES)} or a positive int N (every N-th block)")
    if mode < 1:
        raise ValueError(f"mode={mode}: N checkpoints every N-th block and must be >= 1 (1 is the same as 'full')")
    return ("full", 1) if mode == 1 else ("every", mode)


# Made once: torch.compile guards on them, so every model wrapped the same way reuses the same compiled graphs.
_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, list(SELECTIVE_SAVE))
# A counter per checkpointed call: the recompute must number the matmuls as the forward did.
_OP = lambda: create_selective_checkpoint_contexts(op_policy({}))
_RUN = {
    "full": functools.partial(checkpoint, use_reentrant=False),
    "selective": functools.partial(checkpoint, use_reentrant=False, context_fn=_SELECTIVE),
    "op": functools.partial(checkpoint, use_reentrant=False, context_fn=_OP),
}


def _checkpointed_forward(inner: Callable[..., Any], run: Callable[..., Any]) -> Callable[..., Any]:
    """An unbound forward that runs ``inner(module, ...)`` under ``run`` when a backward will need it."""

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return inner(module, *args, **kwargs)
        return run(inner, module, *args, **kwargs)

    return forward


def apply_activation_checkpointing(
    model: nn.Module,
    mode: str | int = "full",
    *,
    blocks: BlockSpec = "auto",
) -> nn.Module:
    """Checkpoint the activations of ``model``'s blocks in place (before `compile_blocks` and `shard_model`,
    after `enable_float8`); returns ``model``.

    ``mode``: ``"full"`` (every block), an int ``N`` (blocks 0, N, 2N, ...), ``"selective"`` (keep matmul
    and attention outputs, `SELECTIVE_SAVE`) or ``"op"`` (torchtitan's per-op policy, `op_policy`).
    ``blocks`` as for `shard_model` (keep them the same). Only training with grad enabled checkpoints;
    parameter names are unchanged.
    """
    kind, every = resolve_ac_mode(mode)
    found = find_blocks(model, blocks)
    check_order(model, "apply_activation_checkpointing", found)
    run = _RUN["full" if kind == "every" else kind]
    label = mode if isinstance(mode, str) else f"every {every}"
    # One checkpointed forward per distinct inner forward, shared by a class's blocks (compile_blocks: compiled once)
    wrapped: dict[Callable[..., Any], Callable[..., Any]] = {}
    # transformers' checkpointing layer, if transformers is imported (importing it here would be slow and noisy)
    hf_layer = getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", ())
    for index, block in enumerate(found):
        if index % every:
            continue
        if isinstance(block, hf_layer):
            # transformers' own switch: its forward calls this function when training, after
            # dropping cache arguments that a recompute would otherwise update a second time.
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = run
        else:
            inner = current_forward(block)
            block.forward = BlockForward(block, wrapped.setdefault(inner, _checkpointed_forward(inner, run)))
        setattr(block, CHECKPOINTED, label)
    return model
