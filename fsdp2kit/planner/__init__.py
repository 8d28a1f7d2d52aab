"""The memory planner: will a model, batch and set of knobs fit, and what is the cheapest change that makes it fit."""

from fsdp2kit.planner.api import plan_memory
from fsdp2kit.planner.report import MemoryPlan

__all__ = ["MemoryPlan", "plan_memory"]
