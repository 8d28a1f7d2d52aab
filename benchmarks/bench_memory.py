"""Per-rank live-tensor memory of one benchmark variant over a steady-state step (MemTracker).

Live tensor bytes, summed over every storage a dispatched op creates and freed when it is freed,
are the equivalent of CUDA's max_memory_allocated on any device, so CPU and GPU figures compare.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import replace

import torch
import torch.nn as nn
from bench_variants import Variant, build_variant, train_step

__all__ = ["measure_memory"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory(v: Variant, base: nn.Module, mesh, info, batches, args) -> dict:
    """Peak and resident live-tensor bytes on this rank during a steady-state step of ``v``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    eager = replace(v, config=replace(v.config, compile=False))
    model = copy.deepcopy(base).to(info.device)
    tracker = MemTracker()
    # The copy is made outside the tracker and registered: deepcopy under the tracker's
    # dispatch mode double-counts every parameter (its clone is seen twice).
    tracker.track_external(model)
    cuda = info.device.type == "cuda"
    with tracker:
        model, opt = build_variant(eager, model, mesh, info, args)
        train_step(eager, model, opt, batches[0], args)  # optimizer state, FSDP1's lazy buffers
        _sync(info.device)
        tracker.reset_mod_stats()
        _reset_peak(tracker)
        resident = _total(tracker.get_tracker_snapshot("current"))
        if cuda:
            torch.cuda.reset_peak_memory_stats(info.device)
        train_step(eager, model, opt, batches[1], args)
        _sync(info.device)
        peak_snap = tracker.get_tracker_snapshot("peak")
    out = {
        "peak_bytes": _total(peak_snap),
        "resident_bytes": resident,  # between steps: parameters + optimizer state + persistent buffers
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(info.device) if cuda else None,
        "measured_eager": v.config.compile,
    }
    del model, opt, tracker
    gc.collect()
    return out


def _total(snapshot: dict) -> int:
    return int(sum(dev_snap["Total"] for dev_snap in snapshot.values()))


def _reset_peak(tracker) -> None:
    """Start a new peak from the current figure. MemTracker has no public reset of its peak
    (only of per-module stats); these two attributes are the ones its __enter__ initialises."""
    current = tracker.get_tracker_snapshot("current")
    if not (hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap")):
        raise RuntimeError("this torch's MemTracker keeps its peak elsewhere: update _reset_peak")
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in current.items()}
    tracker._peak_mem_snap = copy.deepcopy(current)
