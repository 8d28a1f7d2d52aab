"""Which part of a full tensor this rank holds, and the meshes and devices a sharded model lives on."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (a view into FSDP's padded storage)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_index(t: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's shard in the full tensor, read from the DTensor's placements."""
    if not isinstance(t, DTensor):
        return tuple(slice(None) for _ in t.shape)
    for p in t.placements:
        if type(p) not in (Shard, Replicate):
            raise NotImplementedError(
                f"fsdp2kit reads and writes shards placed as Shard or Replicate; got {t.placements} "
                "(tensor-parallel layouts such as _StridedShard are not supported here)"
            )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def model_meshes(model: nn.Module) -> list:
    found = []
    for p in model.parameters():
        if isinstance(p, DTensor) and all(p.device_mesh is not m for m in found):
            found.append(p.device_mesh)
    return found


def reshard_all(model: nn.Module) -> None:
    """Make sure the sharded parameters are the registered ones (after a forward, they may not be)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor: call it on every rank, in the same order)."""
    if not isinstance(t, DTensor):
        return t.detach()
    local = t._local_tensor
    if local.device.type != t.device_mesh.device_type:  # CPU-offloaded shards of a CUDA mesh
        from fsdp2kit.dist import mesh_device

        t = DTensor.from_local(
            local.to(mesh_device(t.device_mesh.device_type)),
            t.device_mesh,
            t.placements,
            shape=t.shape,
            stride=t.stride(),
        )
    return t.full_tensor()


def is_first_rank(model: nn.Module) -> bool:
    """Whether this rank is the first of the model's mesh (the one that writes files), or the only process."""
    import torch.distributed as dist

    meshes = model_meshes(model)
    if meshes:
        return dist.get_rank() == int(meshes[0].mesh.flatten()[0])
    return not dist.is_initialized() or dist.get_rank() == 0
