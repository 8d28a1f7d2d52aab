"""How the speed and memory wrappers change a block in place, and the order they must come in (how and why:
docs/internals.md, section fsdp2kit/wrappers/forward.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp2kit._internal.markers import TENSOR_PARALLEL

__all__ = ["ORDER", "BlockForward", "check_unsharded", "class_forward", "current_forward"]

ORDER = (
    "enable_float8 -> apply_tensor_parallel -> apply_activation_checkpointing -> compile_blocks -> shard_model "
    "-> set_prefetch"
)


class BlockForward:
    """A block's forward, replaced in place: ``fn(module, *args, **kwargs)``, unbound, so that ``copy.deepcopy``
    gives the copy a forward that runs on the copy."""

    def __init__(self, module: nn.Module, fn: Callable[..., Any]):
        self.module = module
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"BlockForward({getattr(self.fn, '__qualname__', self.fn)!r})"


def class_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's class's forward, looked up at call time: fully_shard later swaps the class for a subclass,
    and some forwards (transformers' ``GradientCheckpointingLayer``) check ``type(self).forward``."""
    return type(module).forward(module, *args, **kwargs)


def current_forward(module: nn.Module) -> Callable[..., Any]:
    """The unbound forward a wrapper should build on: one installed before, or the class's."""
    installed = module.__dict__.get("forward")
    if installed is None:
        return class_forward
    if isinstance(installed, BlockForward) and installed.module is module:
        return installed.fn
    raise ValueError(
        f"{type(module).__name__}.forward was replaced by something fsdp2kit did not install ({installed!r}); "
        "apply fsdp2kit's wrappers to the unmodified model"
    )


def check_unsharded(model: nn.Module, what: str, *, before_tp: bool = False) -> None:
    """Raise if ``shard_model`` (or fully_shard) already ran (`apply_tensor_parallel`'s DTensors are fine);
    with ``before_tp``, also if `apply_tensor_parallel` did."""
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())  # modules() includes the model
    tensor_parallel = getattr(model, TENSOR_PARALLEL, None) is not None
    if sharded or (not tensor_parallel and any(isinstance(p, DTensor) for p in model.parameters())):
        raise ValueError(
            f"{what} must be called before shard_model (the order is {ORDER}); this model is already sharded"
        )
    if before_tp and tensor_parallel:
        raise ValueError(
            f"{what} must be called before apply_tensor_parallel (the order is {ORDER}); this model is already "
            "tensor-parallel"
        )
