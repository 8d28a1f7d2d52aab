"""How the wrappers change a block in place, and the order they must come in (docs/internals.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp2kit._internal.markers import CHECKPOINTED, COMPILED, CONTEXT_PARALLEL, TENSOR_PARALLEL

__all__ = ["ORDER", "BlockForward", "check_order", "class_forward", "current_forward"]

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


def check_order(model: nn.Module, what: str, blocks: list[nn.Module] | None = None) -> None:
    """Raise if ``what`` or a later step of ORDER (``shard_model``, for a step outside it) already ran on ``model``;
    the steps that mark blocks (checkpointing, compile) are looked for on ``blocks``, the ones this call changes."""
    marked = list(model.modules()) if blocks is None else blocks
    tensor_parallel = getattr(model, TENSOR_PARALLEL, None) is not None
    done = {
        "apply_tensor_parallel": tensor_parallel,
        "apply_context_parallel": getattr(model, CONTEXT_PARALLEL, None) is not None,
        "apply_activation_checkpointing": next(
            (getattr(m, CHECKPOINTED) for m in marked if hasattr(m, CHECKPOINTED)), None
        ),
        "compile_blocks": any(getattr(m, COMPILED, False) for m in marked),
        # apply_tensor_parallel's DTensors are not a sharded model
        "shard_model": any(isinstance(m, FSDPModule) for m in model.modules())
        or (not tensor_parallel and any(isinstance(p, DTensor) for p in model.parameters())),
    }
    steps = ORDER.split(" -> ")
    for later in steps[steps.index(what) + 1 : -1] if what in steps else ["shard_model"]:
        if done[later]:
            raise ValueError(f"{what} must be called before {later} (the order is {ORDER})")
    if done.get(what):
        how = f" ({done[what]!r})" if isinstance(done[what], str) else ""  # checkpointing's mode
        where = "this model" if blocks is None else "these blocks"
        raise ValueError(f"{what} was already applied to {where}{how}; call it once")
