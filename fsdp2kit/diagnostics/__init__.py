"""Diagnostics for long runs: non-finite losses and gradients, and hangs or desyncs between ranks."""

from fsdp2kit.diagnostics.desync import DesyncError, RankMonitor
from fsdp2kit.diagnostics.nonfinite import ON_NONFINITE, NonFiniteError, check_finite
from fsdp2kit.diagnostics.position import Position

__all__ = [
    "ON_NONFINITE",
    "DesyncError",
    "NonFiniteError",
    "Position",
    "RankMonitor",
    "check_finite",
]
