"""Per-block ("regional") torch.compile.

How it works and why: docs/internals.md, section fsdp2kit/wrappers/compile.py.
"""

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
from fsdp2kit.wrappers.forward import check_unsharded, current_forward, set_forward

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


def _wait(t: AsyncCollectiveTensor) -> torch.Tensor:
    if t.requires_grad and torch.is_grad_enabled():
        return _WaitKeepGrad.apply(t)
    return t.trigger_wait()


def wait_async_inputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(module, *args, **kwargs)`` with every ``AsyncCollectiveTensor`` argument waited for first.

    In torch 2.13 AOTAutograd unwraps such a graph input without ``requires_grad``
    (pytorch/pytorch#179849, fixed by #191113), which silently drops the gradient of everything
    before the block (the vocabulary-parallel embedding under TP). Waiting here, in eager,
    through an identity autograd function keeps the autograd edge at no copy. Only top-level
    arguments are waited for (nested in a DTensor: pytorch/pytorch#180614). The measured
    effect: docs/internals.md, section wait_async_inputs.
    """

    def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map_only(AsyncCollectiveTensor, _wait, (args, kwargs))
        return fn(module, *args, **kwargs)

    run.__qualname__ = f"wait_async_inputs({getattr(fn, '__qualname__', fn)})"
    return run


def compile_blocks(model: nn.Module, *, blocks: BlockSpec = "auto", **compile_kwargs: Any) -> nn.Module:
    """Compile the forward of each of ``model``'s blocks in place with ``torch.compile``; returns ``model``.

    Call it after `apply_activation_checkpointing` (so the checkpoint is compiled with the
    block: dynamo turns it into a graph region and the op policy of "selective" still applies)
    and before `shard_model`.

    Args:
        model: the unsharded model.
        blocks: which modules are blocks, as for `shard_model`.
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``fullgraph``,
            ``dynamic``, ``options``). On CPU the default backend, inductor, generates C++.

    Compilation is lazy: it happens on the first forward (and again on a change of input shapes
    or dtypes, or of ``train()``/``eval()`` for some models). Parameter names are unchanged; only
    each block's ``forward`` is replaced.

    Tensor parallelism: call it after `apply_tensor_parallel`; the TP layers are compiled with
    the block, and an async TP output fed to a block is waited for before the graph runs (see
    `wait_async_inputs`).

    Hugging Face models: train with ``model.config.use_cache = False``. Otherwise every training
    forward fills a KV cache nobody reads, and since each layer writes its own slot of it
    (``layer_idx``), dynamo compiles every layer separately: compile time grows with depth again.
    """
    check_unsharded(model, "compile_blocks")
    bad = sorted(set(compile_kwargs) - {"fullgraph", "dynamic", "backend", "mode", "options", "disable"})
    if bad:
        raise ValueError(f"compile_blocks: unknown torch.compile arguments {bad}")
    found = find_blocks(model, blocks)
    if getattr(getattr(model, "config", None), "use_cache", False) is True:
        warnings.warn(
            "compile_blocks: model.config.use_cache is True, so each training forward builds a KV cache "
            "and torch.compile compiles every layer separately (the cache guards on the layer index); "
            "set model.config.use_cache = False for training",
            stacklevel=2,
        )
    if any(getattr(b, COMPILED, False) for b in found):
        raise ValueError("compile_blocks was already applied to this model; call it once")
    # One compiled function per distinct forward, so blocks of one class share one dynamo cache
    # entry and torch.compile's wrapper is built once.
    compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
    for block in found:
        fn = current_forward(block)
        if fn not in compiled:
            compiled[fn] = wait_async_inputs(torch.compile(fn, **compile_kwargs))
        set_forward(block, compiled[fn])
        setattr(block, COMPILED, True)
    return model
