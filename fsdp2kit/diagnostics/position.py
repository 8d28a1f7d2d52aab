"""Where this rank is in training (step, micro-step, FSDP unit, phase), kept current by cheap hooks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from fsdp2kit._internal.dtensor import fsdp_units

__all__ = ["PHASES", "Position", "PositionTracker"]

# The phases a rank can be in. The unit phases are marked by hooks around FSDP's collectives and a unit's
# compute (they name the unit); the others are set by the training loop (`PositionTracker.phase`).
_UNIT_PHASES = ("all-gather", "forward", "backward all-gather", "backward", "reduce-scatter")
PHASES = ("start", "data", *_UNIT_PHASES, "optimizer", "check", "checkpoint", "eval", "step end")


@dataclass
class Position:
    step: int = -1
    micro: int = -1  # the micro-step index the training loop gave
    micro_count: int = 0  # micro-steps this rank has begun in this step (counted, not given)
    last_count: int = -1  # micro-steps the previous step had (-1: no previous step in this process)
    phase: str = "start"
    unit: str = ""
    shape: tuple[int, ...] = ()
    since: float = 0.0  # when this phase began (time.time(): hosts compare with clock skew)

    def describe(self, micro_steps: int | None = None) -> str:
        if self.step < 0:
            return f"before the first step ({self.phase})"
        of = f" of {micro_steps}" if micro_steps else ""
        micro = f", micro-step {self.micro}{of}" if self.micro >= 0 else ""
        unit = f" {self.unit or '<root>'}" if self.phase in _UNIT_PHASES else ""
        shape = f", batch {list(self.shape)}" if self.shape else ""
        last = ""
        if self.micro >= 0 and self.micro_count != self.micro + 1:
            last = f" (only {self.micro_count} micro-step{'s' if self.micro_count != 1 else ''} begun in this step)"
        if micro_steps and self.last_count >= 0 and self.last_count != micro_steps:
            last += f" (its previous step had {self.last_count} micro-step{'s' if self.last_count != 1 else ''})"
        return f"step {self.step}{micro}, {self.phase}{unit}{shape}{last}"


class PositionTracker:
    """Keeps `position` current: the loop calls `step`/`micro_step`/`phase`, hooks on the FSDP units mark
    all-gather, forward, backward all-gather, backward and reduce-scatter (docs/long-runs.md): attribute
    writes only."""

    def __init__(self, model: nn.Module | None = None):
        self.position = Position(since=time.time())
        self._handles: list[RemovableHandle] = []
        if model is not None:
            self.attach(model)

    # --- called by the training loop ---------------------------------------------------------
    def step(self, step: int) -> None:
        p = self.position
        p.last_count = p.micro_count if p.step >= 0 else -1
        p.step, p.micro, p.micro_count, p.shape = step, -1, 0, ()
        self._set("data", "")

    def micro_step(self, index: int, batch: torch.Tensor | None = None) -> None:
        p = self.position
        p.micro = index
        p.micro_count += 1
        p.shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else ()
        self._set("data", "")

    def phase(self, phase: str, unit: str = "") -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        self._set(phase, unit)

    def _set(self, phase: str, unit: str) -> None:
        p = self.position
        p.phase, p.unit, p.since = phase, unit, time.time()

    # --- hooks --------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Hook every FSDP unit of ``model`` (call after ``shard_model``); `detach` removes the hooks."""
        fsdp_units(model, type(self).__name__)  # a clear error when there are none
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                self._hook(name, module)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str, module: nn.Module) -> None:
        def mark_grad(tensors, phase: str) -> None:
            grads = (t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor) and t.requires_grad)
            if torch.is_grad_enabled() and (t := next(grads, None)) is not None:
                t.register_hook(lambda grad: self._set(phase, name))

        def after_fsdp(mod, args):
            self._set("forward", name)
            mark_grad(args, "reduce-scatter")  # the unit's backward is done when its input's gradient is

        self._handles += [
            # prepend=True and registered after fully_shard: runs before FSDP's own pre-forward hook.
            module.register_forward_pre_hook(lambda mod, args: self._set("all-gather", name), prepend=True),
            module.register_forward_pre_hook(after_fsdp),
            # Runs before FSDP's post-forward, so its gradient hook is registered (and runs) first.
            module.register_forward_hook(lambda mod, args, out: mark_grad(out, "backward all-gather"), prepend=True),
            module.register_forward_hook(lambda mod, args, out: mark_grad(out, "backward")),
        ]
