"""Diagnostics for long runs: non-finite losses and gradients, and hangs or desyncs between ranks."""

from fsdp2kit.diagnostics.desync import DesyncError, Position, RankMonitor
from fsdp2kit.diagnostics.nonfinite import ON_NONFINITE, NonFiniteError, check_finite

__all__ = ["ON_NONFINITE", "DesyncError", "NonFiniteError", "Position", "RankMonitor", "check_finite"]
