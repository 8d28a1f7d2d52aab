"""Real storage for a model built on the meta device: where the shards live, and ties kept."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp2kit._internal.agree import all_ranks_or_none
from fsdp2kit._internal.dtensor import model_meshes, reshard_all
from fsdp2kit.blocks import tied_slots
from fsdp2kit.dist import mesh_device
from fsdp2kit.weights.buffers import fill_buffers


def target_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Offloaded shards live in CPU memory whatever the mesh's device is.
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None and isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
                return torch.device("cpu")
    meshes = model_meshes(model)
    kind = meshes[0].device_type if meshes else ("cuda" if torch.cuda.is_available() else "cpu")
    return mesh_device(kind)


def allocate(model: nn.Module, device: torch.device) -> tuple[set[str], set[str]]:
    """Give every meta tensor storage on ``device``; returns the names of those that were meta. Weights
    shared by two modules come out of ``_apply`` as two plain tensors: they are tied again."""
    params = {n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    buffers = {n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
    if not params and not buffers:
        return params, buffers
    ties = tied_slots(model)
    reshard_all(model)

    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for slots in ties:
        _, module, name = slots[0]
        shared = module._parameters[name]
        for _, other, other_name in slots[1:]:
            other._parameters[other_name] = shared
    return params, buffers


def allocate_for_load(model: nn.Module, what: str = "allocating the meta-built model") -> None:
    """Storage for a meta-built model whose values all come from a checkpoint (no init is run); its
    non-persistent buffers are recomputed by its construction code, or it is an error."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    with all_ranks_or_none(model, what):
        _, buffers = allocate(model, target_device(model, None))
        fill_buffers(model, buffers, missing_ok=False)
