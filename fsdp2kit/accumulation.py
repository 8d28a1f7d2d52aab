"""Accumulation policies: what FSDP2 sends and keeps (docs/accumulation.md; bytes: `fsdp2kit.planner.comm`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp2kit._internal.dtensor import fsdp_units
from fsdp2kit.replicated import paused

__all__ = ["ACCUMULATION", "accumulate", "check_accumulation"]

# What each sends and holds, in a line (docs/accumulation.md, "Accumulation policies", has the whole table).
ACCUMULATION: dict[str, str] = {
    "regather": "FSDP2's default: gather, re-gather in backward and reduce every micro-batch; holds nothing",
    "keep_gathered": "gather once a step, reduce every micro-batch; holds the unsharded model (compute dtype)",
    "defer_all_reduce": "HSDP: reduce-scatter every micro-batch, all-reduce once; holds sharded partial sums",
    "no_sync": "gather every micro-batch, reduce once, on the last; holds every unsharded gradient",
    "keep_gathered_defer_all_reduce": "HSDP: keep_gathered, all-reducing across replicas once, on the last",
    "keep_gathered_no_sync": "gather once and reduce once a step: the fewest bytes, the most memory",
}
_HSDP_ONLY = ("defer_all_reduce", "keep_gathered_defer_all_reduce")

# A keep_gathered step's saved reshard-after-forward settings: FSDP2's public setter takes a bool only, so an int
# (reshard to a smaller group) is restored from its private per-group field.
_SAVED = "_fsdp2kit_saved_reshard_after_forward"


def check_accumulation(policy: str, *, hsdp: bool | None = None) -> str:
    """``policy`` if it is a policy name (and fits the mesh when ``hsdp`` is known), else ``ValueError``."""
    if policy not in ACCUMULATION:
        raise ValueError(f"accumulation={policy!r}: expected one of {list(ACCUMULATION)}")
    if policy in _HSDP_ONLY and hsdp is False:
        raise ValueError(
            f"accumulation={policy!r} defers the all-reduce across replicas: it needs an HSDP mesh "
            "(make_mesh(shard=..., replicate=...) with replicate > 1); on a 1-D mesh use 'no_sync' or 'keep_gathered'"
        )
    return policy


@contextlib.contextmanager
def accumulate(model: nn.Module, policy: str, micro: int, n_micro: int) -> Iterator[None]:
    """Run micro-batch ``micro`` (0-based) of ``n_micro`` under an accumulation ``policy`` (`ACCUMULATION`; what each
    sends, holds and switches: docs/accumulation.md, "Accumulation policies"). Wrap each micro-batch's backward::

        for micro, batch in enumerate(micro_batches):
            with fk.accumulate(model, "keep_gathered", micro, len(micro_batches)):
                (loss_fn(model, batch) / len(micro_batches)).backward()
        optimizer.step()

    Each FSDP2 setting it changes goes back to FSDP2's default when the block exits (keep_gathered's after the last
    micro-batch, or a block that raises), so do not nest it in `fsdp2kit.no_sync` or under settings of your own.
    """
    check_accumulation(policy)
    if isinstance(n_micro, bool) or not isinstance(n_micro, int) or n_micro < 1:
        raise ValueError(f"n_micro={n_micro!r}: expected a positive int")
    if isinstance(micro, bool) or not isinstance(micro, int) or not 0 <= micro < n_micro:
        raise ValueError(f"micro={micro!r}: expected 0 <= micro < n_micro={n_micro}")
    modules = fsdp_units(model, "accumulate")
    if policy in _HSDP_ONLY and micro == 0:  # sharded then: a kept-gathered parameter is no DTensor
        meshes = {p.device_mesh for m in modules for p in m.parameters() if isinstance(p, DTensor)}
        hsdp = any(
            m.size(m.mesh_dim_names.index("replicate")) > 1 for m in meshes if "replicate" in (m.mesh_dim_names or ())
        )
        check_accumulation(policy, hsdp=hsdp)
    last = micro == n_micro - 1
    keep = policy.startswith("keep_gathered") and n_micro > 1
    # The FSDP2 switches this micro-batch turns off, each back on (FSDP2's default) when the block exits.
    turned_off = {
        FSDPModule.set_requires_gradient_sync: policy in ("no_sync", "keep_gathered_no_sync"),
        FSDPModule.set_requires_all_reduce: policy in _HSDP_ONLY,
        FSDPModule.set_reshard_after_backward: keep,
    }
    switches = [setter for setter, off in turned_off.items() if off and not last]
    if keep and micro == 0:
        if getattr(model, _SAVED, None) is not None:
            raise RuntimeError("accumulate: the previous keep_gathered step did not reach its last micro-batch")
        saved = []
        for m in modules:
            state = m._get_fsdp_state()
            infos = [g.post_forward_mesh_info for g in state._fsdp_param_groups]
            saved.append((state, state._auto_reshard_after_forward, infos))
            m.set_reshard_after_forward(False, recurse=False)
        setattr(model, _SAVED, saved)
    ok = False
    try:
        for m, setter in itertools.product(modules, switches):
            setter(m, False, recurse=False)
        with paused(model, not last):
            yield
        ok = True
    finally:
        for m, setter in itertools.product(modules, switches):
            setter(m, True, recurse=False)
        if keep and (last or not ok):
            for state, auto, infos in getattr(model, _SAVED, None) or ():
                state._auto_reshard_after_forward = auto
                for group, info in zip(state._fsdp_param_groups, infos):
                    group.post_forward_mesh_info = info
            vars(model).pop(_SAVED, None)
            if not ok:  # a step abandoned half-way frees what it kept gathered
                for m in modules:
                    m.reshard()
