"""NF4 shards quantized from each rank's own rows, identical to quantizing the whole weight then sharding."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit.weights.nf4 import NF4_INNER_TENSORS, is_nf4


def allocate_nf4(model: nn.Module, device: torch.device) -> None:
    """Empty storage for all five inner tensors of every meta NF4 weight (torchao's ``empty_like`` leaves two
    on meta), through ``Module._apply`` so that FSDP2 re-registers each new shard."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, construct_nf4_args

    if not any(p.is_meta and is_nf4(p) for p in model.parameters()):
        return

    def fn(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_meta and is_nf4(t)):
            return t
        inner = {name: torch.empty_like(getattr(local_shard(t), name), device=device) for name in NF4_INNER_TENSORS}
        local = NF4Tensor(*construct_nf4_args(local_shard(t), {**inner, "device": device}))
        if not isinstance(t, DTensor):
            return local
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())

    model._apply(fn)


def quantize_rows(
    rows: torch.Tensor, block_size: int, scaler_block_size: int, *, group=None
) -> dict[str, torch.Tensor]:
    """NF4's inner tensors for one rank's rows of a weight, bit for bit its part of ``to_nf4(full weight)``: the
    scalers' mean, the one value that depends on the whole weight, is agreed over ``group`` (collective)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, get_block_absmax, to_nf4

    flat = rows.reshape(-1)
    absmax = get_block_absmax(flat, block_size)
    if group is None:
        mean = absmax.mean()
    else:  # gathered and reduced in order, as to_nf4 does (an all-reduce of partial sums could round otherwise)
        wire = absmax.contiguous().view(torch.uint8)  # bytes: gloo has no int16 / bfloat16 all-gather
        parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, wire, group=group)
        mean = torch.cat(parts).view(absmax.dtype).mean()
    centred = absmax - mean
    n_groups = centred.numel() // scaler_block_size
    group_absmax = get_block_absmax(centred, scaler_block_size).unsqueeze(-1).expand(n_groups, scaler_block_size)
    factor = 256 / (2 * group_absmax)
    scalers = (centred.view(n_groups, scaler_block_size) * factor).round().clamp(-128, 127)
    # The 16-value table exactly as to_nf4 builds it (dtype and device of the weight); torchao's code search
    # runs in chunks of 1M weights, so its peak does not grow with the shard.
    ones = torch.ones(block_size * scaler_block_size, dtype=rows.dtype, device=rows.device)
    table = to_nf4(ones, block_size, scaler_block_size).nf4
    data = NF4Tensor.convert_to_norm_float_weight(flat, flat.numel() // block_size, block_size, table)
    return {
        "quantized_data": data,
        "quantized_scalers": scalers.flatten().to(torch.int8),
        "quantization_factor": factor[:, 0].contiguous(),
        "scaler_mean": mean,
        "nf4": table,
    }


def fill_nf4(target: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize ``rows`` (this rank's rows of the full weight) into the NF4 shard ``target`` (collective
    over its shard group)."""
    local = local_shard(target)
    rows = rows.to(device=local.quantized_data.device, dtype=local.dtype).contiguous()
    group = None  # the group over which the rows are split (None: every rank holds all of them)
    if isinstance(target, DTensor):
        dims = [d for d, p in enumerate(target.placements) if isinstance(p, Shard) and target.device_mesh.size(d) > 1]
        group = target.device_mesh.get_group(dims[0]) if dims else None
    parts = quantize_rows(rows, local.block_size, local.scaler_block_size, group=group)
    for name, value in parts.items():
        getattr(local, name).copy_(value.reshape(getattr(local, name).shape))
