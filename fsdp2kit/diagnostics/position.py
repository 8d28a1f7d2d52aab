"""Where a rank is in training (step, micro-step, FSDP unit, phase); `RankMonitor` keeps it current."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PHASES", "Position"]

# The phases a rank can be in. The unit phases are marked by hooks around FSDP's collectives and a unit's
# compute (they name the unit); the others are set by the training loop (`RankMonitor.phase`).
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
