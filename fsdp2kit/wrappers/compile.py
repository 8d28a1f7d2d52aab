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

    Why: a TP layer run in eager returns its output as an ``AsyncCollectiveTensor`` (torch's
    functional all-reduce, launched asynchronously; ``to_local()`` hands back that wrapper). In
    torch 2.13, AOTAutograd unwraps such a graph input with ``trigger_wait()``, which returns the
    inner tensor *without* ``requires_grad`` (pytorch/pytorch#179849), so the compiled graph is
    traced as if the input needed no gradient and its backward returns none: the gradient of
    everything before the block is lost (with a Llama under TP, the vocabulary-parallel
    embedding's: a 3-layer Llama at TP 2 ended 4.2e-2 from the eager reference after 3 AdamW
    steps, 7.5e-2 with a tied head; with some losses its ``Redistribute`` backward is instead
    handed a zero plain tensor and raises). Fixed upstream by pytorch/pytorch#191113 (preserve
    requires_grad when unwrapping ACT inputs). Waiting here, in eager, through an identity
    autograd function gives the graph a plain tensor that keeps its autograd edge; it costs no
    copy, the wait happens where the graph would have waited anyway (on entry), and the first
    block no longer gets a graph of its own (its input type differed from the other blocks').

    Only top-level tensor arguments are waited for: an ``AsyncCollectiveTensor`` nested in a
    DTensor argument (an eager style with ``use_local_output=False`` in front of a block; no
    transformers plan does that) is left to torch (pytorch/pytorch#180614).
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
