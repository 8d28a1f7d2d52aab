"""Which part of a full tensor this rank holds, and the meshes and devices a sharded model lives on."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (a view into FSDP's padded storage)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_index(t: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's shard in the full tensor, one slice per dim (torch's own
    ``compute_local_shape_and_global_offset``, as DCP: FSDP, HSDP, FSDP over TP)."""
    if not isinstance(t, DTensor):
        return tuple(slice(None) for _ in t.shape)
    if t.device_mesh.get_coordinate() is None:
        raise RuntimeError("this rank is not part of the tensor's mesh")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def model_meshes(model: nn.Module) -> list:
    """The meshes of a model's DTensor parameters, the largest first (with TP, norms live on the
    data-parallel mesh and split weights on the whole one: the first then spans every rank)."""
    found = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    return sorted(found.values(), key=lambda m: -m.size())


def fsdp_units(model: nn.Module, caller: str) -> list:
    """The model's ``fully_shard`` modules; ``ValueError`` naming ``caller`` when it has none."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{caller}: {type(model).__name__} has no FSDP units; call shard_model first")
    return modules


def reshard_all(model: nn.Module) -> None:
    """Make sure the sharded parameters are the registered ones (after a forward, they may not be)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor: call it on every rank, in the same order)."""
    if not isinstance(t, DTensor):
        return t.detach()
    mesh = t.device_mesh
    if t._local_tensor.device.type != mesh.device_type:  # CPU-offloaded shards of a CUDA mesh
        from fsdp2kit.dist import mesh_device

        local = t._local_tensor.to(mesh_device(mesh.device_type))
        t = DTensor.from_local(local, mesh, t.placements, shape=t.shape, stride=t.stride())
    if type(t._local_tensor).__name__ == "NF4Tensor":
        return _gather_nf4(t)
    return t.full_tensor()


def _gather_nf4(t: DTensor) -> torch.Tensor:
    """A row-sharded NF4 DTensor, whole, gathered with synchronous all-gathers: torchao's own hands back
    unwaited functional gathers, after which a rank's heap was corrupted in ~1 run in 6 on gloo."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, construct_nf4_args

    from fsdp2kit.weights.nf4 import NF4_ROW_TENSORS

    local = t._local_tensor
    dims = [d for d, p in enumerate(t.placements) if isinstance(p, Shard)]
    if [t.placements[d].dim for d in dims] not in ([], [0]):
        raise NotImplementedError(f"NF4 weights are gathered by rows only, not {t.placements}")
    parts = {}
    for name in NF4_ROW_TENSORS:
        part = getattr(local, name).contiguous()
        if dims:
            group = t.device_mesh.get_group(dims[0])
            whole = part.new_empty((part.shape[0] * dist.get_world_size(group), *part.shape[1:]))
            dist.all_gather_into_tensor(whole, part, group=group)
            part = whole
        parts[name] = part
    n_blocks = parts["quantized_scalers"].numel()
    return NF4Tensor(*construct_nf4_args(local, {**parts, "size": t.shape, "n_blocks": n_blocks}))


def is_first_rank(model: nn.Module) -> bool:
    """Whether this rank is the first of the model's mesh (the one that writes files), or the only process."""
    meshes = model_meshes(model)
    if meshes:
        return dist.get_rank() == int(meshes[0].mesh.flatten()[0])
    return not dist.is_initialized() or dist.get_rank() == 0
