"""NF4 shards quantized from each rank's own rows, identical to quantizing the whole weight then sharding."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit.weights.nf4 import NF4_INNER_TENSORS, is_nf4

__all__ = ["allocate_nf4", "fill_nf4", "nf4_load_problem", "quantize_rows"]

_PIECE = 1 << 16  # weights quantized at once (a multiple of any block size up to 65536)


def nf4_load_problem(t: torch.Tensor) -> str | None:
    """Why the NF4 weight ``t`` cannot be quantized from its rank's rows, or None.

    A rank's rows must be whole row blocks of FSDP's dim-0 split (``Shard(0)`` on one mesh dim,
    anything else replicated): tensor parallelism splits the columns, and no rank would then hold
    whole quantization blocks of the full weight's flat order.
    """
    if not isinstance(t, DTensor):
        return None
    shards = [p for p in t.placements if not isinstance(p, Replicate)]
    if len(shards) > 1 or any(not isinstance(p, Shard) or p.dim != 0 for p in shards):
        return f"placed {t.placements}: NF4 weights can only be sharded by FSDP on dim 0 (no tensor parallelism)"
    return None


def _shard_group(t: torch.Tensor):
    """The process group over which ``t``'s rows are split (None: every rank holds all of them)."""
    if not isinstance(t, DTensor):
        return None
    for dim, p in enumerate(t.placements):
        if isinstance(p, Shard) and t.device_mesh.size(dim) > 1:
            return t.device_mesh.get_group(dim)
    return None


def _empty_nf4(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A meta NF4 shard's twin with real, uninitialised storage for all five inner tensors.

    (torchao's ``empty_like`` moves only the three sharded inner tensors and leaves the
    scalers' mean and the NF4 table on meta, so it cannot be used here.)
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, construct_nf4_args

    inner = {name: torch.empty_like(getattr(local, name), device=device) for name in NF4_INNER_TENSORS}
    return NF4Tensor(*construct_nf4_args(local, {**inner, "device": device}))


def allocate_nf4(model: nn.Module, device: torch.device) -> list[str]:
    """Give every meta NF4 weight (from `quantize_nf4` on a meta model) real, empty storage.

    The model's other tensors are left as they are. Goes through ``Module._apply``, so FSDP2
    re-registers each new shard (its ``_apply`` re-reads the sharded parameters).
    """
    names = [n for n, p in model.named_parameters() if p.is_meta and is_nf4(p)]
    if not names:
        return names

    def fn(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_meta and is_nf4(t)):
            return t
        local = _empty_nf4(local_shard(t), device)
        if not isinstance(t, DTensor):
            return local
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())

    model._apply(fn)
    return names


def _agreed_mean(absmax: torch.Tensor, group) -> torch.Tensor:
    """The mean of every block scaler of the whole weight, from this rank's part of them.

    Gathering the scalers (1/block_size of the weight) and taking ``mean()`` of the whole
    vector in order is what ``to_nf4`` does on the full weight, so the result is the same bits;
    an all-reduce of partial sums would add in another order and could round differently.
    """
    if group is None:
        return absmax.mean()
    # Sent as bytes: the bits travel unchanged, and gloo has no int16 / bfloat16 all-gather.
    wire = absmax.contiguous().view(torch.uint8)
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, wire, group=group)
    return torch.cat(parts).view(absmax.dtype).mean()


def quantize_rows(
    rows: torch.Tensor, block_size: int, scaler_block_size: int, *, group=None
) -> dict[str, torch.Tensor]:
    """NF4's inner tensors for ``rows`` (one rank's row block of a weight) in ``rows``' dtype.

    Everything NF4 stores is local to a block of ``block_size`` weights or to a group of
    ``scaler_block_size`` blocks, except the mean subtracted from the block scalers before they
    are quantized to int8: with ``group``, that mean is agreed over the ranks of the group
    (collective), so the result is this rank's part of ``to_nf4(full weight)``, bit for bit.
    The arithmetic is torchao's ``NF4Tensor.double_quantize_scalers`` with the mean given.
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, get_block_absmax, to_nf4

    flat = rows.reshape(-1)
    absmax = get_block_absmax(flat, block_size)
    mean = _agreed_mean(absmax, group)
    centred = absmax - mean
    n_groups = centred.numel() // scaler_block_size
    group_absmax = get_block_absmax(centred, scaler_block_size).unsqueeze(-1).expand(n_groups, scaler_block_size)
    factor = 256 / (2 * group_absmax)
    scalers = (centred.view(n_groups, scaler_block_size) * factor).round().clamp(-128, 127)
    # The 16-value table exactly as to_nf4 builds it (dtype and device of the weight).
    ones = torch.ones(block_size * scaler_block_size, dtype=rows.dtype, device=rows.device)
    table = to_nf4(ones, block_size, scaler_block_size).nf4
    # The 4-bit codes, a piece at a time: each code depends on its own block only, and torchao's
    # nearest-value search holds 16 values per weight (x2) for up to 1M weights at once (about
    # 70 MB in bf16): pieces of _PIECE weights keep that scratch near 5 MB, with the same bits.
    data = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=rows.device)
    piece = max(block_size, _PIECE // block_size * block_size)
    for start in range(0, flat.numel(), piece):
        part = flat[start : start + piece]
        codes = NF4Tensor.convert_to_norm_float_weight(part, part.numel() // block_size, block_size, table)
        data[start // 2 : start // 2 + codes.numel()] = codes
    return {
        "quantized_data": data,
        "quantized_scalers": scalers.flatten().to(torch.int8),
        "quantization_factor": factor[:, 0].contiguous(),
        "scaler_mean": mean,
        "nf4": table,
    }


def fill_nf4(target: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize ``rows`` (this rank's rows of the full weight, any float dtype) into the NF4 shard ``target``.

    Collective over ``target``'s shard group: every rank of it calls this for the same weight.
    """
    local = local_shard(target)
    if tuple(rows.shape) != tuple(local.shape):
        raise RuntimeError(f"internal: read rows of shape {tuple(rows.shape)} for an NF4 shard of {tuple(local.shape)}")
    rows = rows.to(device=local.quantized_data.device, dtype=local.dtype).contiguous()
    parts = quantize_rows(rows, local.block_size, local.scaler_block_size, group=_shard_group(target))
    for name, value in parts.items():
        getattr(local, name).copy_(value.reshape(getattr(local, name).shape))
