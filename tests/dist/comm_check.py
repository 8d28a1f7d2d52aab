"""Counted collectives against predicted ones, as comparable lists, inside `run_world` ranks."""

from __future__ import annotations

from fsdp2kit.diagnostics.collectives import CollectiveCounts
from fsdp2kit.planner.comm import CommPlan

DP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def counted_calls(counts: CollectiveCounts, groups: tuple[str, ...] = ("shard", "replicate")) -> list[tuple]:
    """Every counted call on the data-parallel groups as (kind, group, bytes, dtype), sorted; a group outside
    the mesh (an int reshard_after_forward's smaller one) as "shard/<ranks>", as the prediction names it."""
    out = []
    for e in counts.events:
        group = e.group if e.group in groups else f"shard/{e.group_size}"
        if e.group in groups or e.group not in ("tp", "world"):
            out.append((e.kind, group, e.nbytes, e.dtype))
    return sorted(out)


def predicted_calls(plan: CommPlan) -> list[tuple]:
    """The prediction's calls, one tuple per call, in the form of `counted_calls`."""
    return sorted(
        (c.kind, c.group, c.nbytes, c.dtype) for u in plan.units for c in u.collectives for _ in range(c.count)
    )
