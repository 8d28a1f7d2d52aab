"""Diagnostics for long runs: non-finite losses and gradients, and hangs or desyncs between ranks."""

from fsdp2kit.diagnostics.desync import DesyncError, RankMonitor
from fsdp2kit.diagnostics.nonfinite import ON_NONFINITE, NonFiniteError, check_finite, nonfinite_modules
from fsdp2kit.diagnostics.position import PHASES, Position, PositionTracker

__all__ = [
    "ON_NONFINITE",
    "PHASES",
    "DesyncError",
    "NonFiniteError",
    "Position",
    "PositionTracker",
    "RankMonitor",
    "check_finite",
    "nonfinite_modules",
]
