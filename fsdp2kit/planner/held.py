"""What an accumulation policy holds between micro-batches, as units for the replay (docs/accumulation.md, "Memory")."""

from __future__ import annotations

import dataclasses

from fsdp2kit.planner.timeline import Unit

__all__ = ["micro_batch_units"]


def micro_batch_units(
    units: list[Unit], policy: str, m: int, grad_scale: float, replicated: bool = False
) -> list[tuple[list[Unit], dict[str, int], bool]]:
    """Per distinct micro-batch of ``m`` under ``policy``: its units, ``{part: bytes}`` held through it, whether its
    gradients add in place; ``grad_scale``: reduce- per compute-dtype byte (docs/accumulation.md, "Memory")."""
    keep = policy.startswith("keep_gathered")
    no_sync = policy.endswith("no_sync")
    defer = policy.endswith("defer_all_reduce")
    held = [int(u.unsharded_grads * grad_scale) if no_sync else u.reduce_output if defer else 0 for u in units]
    out: list[tuple[list[Unit], dict[str, int], bool]] = []
    kinds = ("first",) if m == 1 else ("first", "middle", "last") if m > 2 else ("first", "last")
    for kind in kinds:
        first, last = kind == "first", kind == "last"
        extra = {"gathered": 0, "unsharded_grads": 0, "grads": 0}
        us = []
        # A unit set unsharded (or with live gradients) here frees its held bytes when the replay reshards (or
        # reduces) it: the bytes added to ``extra`` cancel that.
        for u, h in zip(units, held):
            r = dataclasses.replace(u)
            if keep and m > 1:
                extra["gathered"] += u.gathered
                if last:  # gathered since the first forward; resharded after this backward
                    r.unsharded, r.reshard_after_forward = True, False
                else:
                    r.gathered = 0
            if h and not last:
                # The reduction is withheld (no_sync) or stops short of the all-reduce (defer): its
                # result is carried, created in the first micro-batch, added to in place after it.
                if no_sync:
                    r.reduce_input = r.reduce_output = 0
                r.sharded_grads = h if first else 0
                extra["unsharded_grads" if no_sync else "grads"] += 0 if first else h
            elif h:  # the last micro-batch reduces the carried sum, freeing it, and sets .grad
                r.grads_live = h
                extra["unsharded_grads"] += h
            elif not first:  # .grad exists from the first micro-batch; later ones add to it in place
                r.sharded_grads = 0
                extra["grads"] += u.sharded_grads
            us.append(r)
        variant = (us, extra, (replicated or (no_sync and grad_scale == 1)) and not first)
        if variant not in out:
            out.append(variant)
    return out
