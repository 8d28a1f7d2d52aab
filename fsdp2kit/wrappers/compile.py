"""Per-block ("regional") torch.compile (how and why: docs/internals.md, section fsdp2kit/wrappers/compile.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._pytree import tree_map_only

from fsdp2kit._internal.markers import COMPILED
from fsdp2kit.blocks import BlockSpec, find_blocks
from fsdp2kit.wrappers.forward import BlockForward, check_order, current_forward

__all__ = ["compile_blocks", "wait_async_inputs"]


class _WaitKeepGrad(torch.autograd.Function):
    """Wait for an async collective's result; the gradient passes through unchanged (it is an identity)."""

    @staticmethod
    def forward(ctx, t: AsyncCollectiveTensor) -> torch.Tensor:
        done = t.trigger_wait()
        # A fresh tensor object over the same memory: autograd writes its grad_fn into the
        # output, which must not land on the tensor the collective result lives in.
        return done.view_as(done)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def wait_async_inputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(module, *args, **kwargs)`` with top-level ``AsyncCollectiveTensor`` arguments waited for first, keeping
    their gradient: AOTAutograd drops it otherwise (pytorch/pytorch#179849; docs/internals.md, wait_async_inputs)."""

    def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map_only(AsyncCollectiveTensor, _WaitKeepGrad.apply, (args, kwargs))
        return fn(module, *args, **kwargs)

    run.__qualname__ = f"wait_async_inputs({getattr(fn, '__qualname__', fn)})"
    return run


def compile_blocks(model: nn.Module, *, blocks: BlockSpec = "auto", **compile_kwargs: Any) -> nn.Module:
    """Compile the forward of each of ``model``'s blocks in place with ``torch.compile``; returns ``model``.

    Call it after `apply_activation_checkpointing` (the checkpoint is compiled with the block) and
    `apply_tensor_parallel`, and before `shard_model`. ``blocks`` as for `shard_model`; ``compile_kwargs``
    go to ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``). Compilation
    happens on the first forward. Hugging Face models: train with ``model.config.use_cache = False``, or
    every layer compiles separately (docs/internals.md).
    """
    bad = sorted(set(compile_kwargs) - {"fullgraph", "dynamic", "backend", "mode", "options", "disable"})
    if bad:
        raise ValueError(f"compile_blocks: unknown torch.compile arguments {bad}")
    found = find_blocks(model, blocks)
    check_order(model, "compile_blocks", found)
    if getattr(getattr(model, "config", None), "use_cache", False) is True:
        warnings.warn(
            "compile_blocks: model.config.use_cache is True, so each training forward builds a KV cache and "
            "torch.compile compiles every layer apart (it guards on the layer index); set it False for training",
            stacklevel=2,
        )
    # One compiled function per distinct forward: a class's blocks share one dynamo cache entry and wrapper
    compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
    for block in found:
        fn = current_forward(block)
        if fn not in compiled:
            compiled[fn] = wait_async_inputs(torch.compile(fn, **compile_kwargs))
        block.forward = BlockForward(block, compiled[fn])
        setattr(block, COMPILED, True)
    return model
