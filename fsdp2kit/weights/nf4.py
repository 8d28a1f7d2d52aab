"""quantize_nf4: the frozen Linear weights of a model's blocks as torchao NF4 tensors (QLoRA's base), and NF4 shards
quantized from each rank's own rows, identical to quantizing the whole weight then sharding."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit.blocks import BlockSpec, find_blocks

# A torchao NF4Tensor's inner tensors (attribute names). FSDP2 splits the first three by rows, as
# torchao's fsdp_pre_all_gather gathers them; the scalers' mean and the 16-value NF4 table are
# whole on every rank.
NF4_ROW_TENSORS = ("quantized_data", "quantized_scalers", "quantization_factor")
NF4_INNER_TENSORS = (*NF4_ROW_TENSORS, "scaler_mean", "nf4")
_PIECE = 1 << 16  # weights quantized at once by quantize_rows (a multiple of any block size up to 65536)


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local shard) is a torchao NF4Tensor (by name: torchao is QLoRA-only)."""
    t = local_shard(t)
    return type(t).__name__ == "NF4Tensor" and hasattr(t, "quantized_data")


def nf4_shard_problem(t: torch.Tensor, shard: int) -> str | None:
    """Why ``t`` (an NF4Tensor) cannot be split into ``shard`` equal row blocks of whole scaler groups
    (FSDP would pad, which NF4 cannot represent), or None."""
    per_rank, group = t.numel() // shard, t.block_size * t.scaler_block_size
    if t.shape[0] % shard:
        return f"{t.shape[0]} rows do not split evenly over {shard} ranks"
    if per_rank % group:
        return (
            f"{per_rank} elements per rank are not a multiple of block_size x scaler_block_size = "
            f"{t.block_size} x {t.scaler_block_size}"
        )
    return None


def meta_nf4(shape: torch.Size, dtype: torch.dtype, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """A meta NF4Tensor (``to_nf4`` of a meta weight: a real one's inner tensors), which FSDP2 shards
    like a real one: the placeholder `fsdp2kit.load_pretrained` fills."""
    from torchao.quantization import to_nf4

    return to_nf4(torch.empty(shape, dtype=dtype, device="meta"), block_size, scaler_block_size)


def quantize_nf4(
    model: nn.Module,
    *,
    blocks: BlockSpec = "auto",
    block_size: int = 64,
    scaler_block_size: int = 256,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Replace the weight of every ``nn.Linear`` inside the model's blocks by a frozen NF4Tensor (docs/lora.md).

    QLoRA's base, about 0.52 byte per parameter. Call it before PEFT wrapping and `shard_model`; on a
    meta-built model each weight becomes a placeholder that `load_pretrained` quantizes from each
    rank's rows. Embeddings, the output head, norms and biases stay as they are.

    Args:
        blocks: which modules are the blocks, as for `shard_model` (``"auto"``, classes, predicate).
        block_size, scaler_block_size: NF4 quantization groups. A weight whose element count is
            not a multiple of ``block_size * scaler_block_size`` is left unquantized (and named
            in the error if no weight qualifies).
        dtype: the dtype the weights dequantize to for compute; default: the weight's own dtype.

    Returns the names of the quantized weights.
    """
    with quiet_imports():  # torchao's import-time log lines on a CPU build
        from torchao.quantization import to_nf4
    # fully_shard's (and TP's) parameters are DTensors, except while FSDP2 holds them unsharded
    sharded = any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )
    if sharded or any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules()):
        raise ValueError(
            f"quantize_nf4 must run before shard_model and before PEFT wrapping: the model is already "
            f"{'sharded' if sharded else 'wrapped'}. Quantize the base model, wrap it with peft (its layers wrap the "
            "NF4 weights and train adapters beside them), then call shard_model"
        )
    names = {id(m): n for n, m in model.named_modules()}
    group = block_size * scaler_block_size
    done, skipped = [], []  # weight names; "name (shape)" of those left unquantized
    for block in find_blocks(model, blocks):
        for module in block.modules():
            if not isinstance(module, nn.Linear) or is_nf4(module.weight):
                continue
            name = f"{names[id(module)]}.weight"
            w = module.weight
            if w.numel() % group:
                skipped.append(f"{name} {tuple(w.shape)}")
                continue
            with torch.no_grad():  # a meta weight gives a meta NF4 placeholder, filled by load_pretrained
                nf4 = to_nf4(w.detach().to(dtype or w.dtype).contiguous(), block_size, scaler_block_size)
            module.weight = nn.Parameter(nf4, requires_grad=False)
            done.append(name)
    if not done:
        why = (
            f"none of its {len(skipped)} nn.Linear weights has a multiple of block_size x scaler_block_size = "
            f"{block_size} x {scaler_block_size} = {group} elements ({', '.join(skipped[:6])})"
            if skipped
            else "its blocks hold no nn.Linear (a model with Conv1D layers, e.g. GPT-2, is not supported)"
        )
        raise ValueError(f"quantize_nf4: nothing to quantize in {type(model).__name__}: {why}")
    return done


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
    # The 16-value table exactly as to_nf4 builds it (dtype and device of the weight).
    ones = torch.ones(block_size * scaler_block_size, dtype=rows.dtype, device=rows.device)
    table = to_nf4(ones, block_size, scaler_block_size).nf4
    # The 4-bit codes, a piece at a time: torchao's nearest-value search holds 16 values per weight
    # (about 70 MB in bf16 for 1M weights); pieces of _PIECE weights keep it near 5 MB, same bits.
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
    """Quantize ``rows``, this rank's rows of the full weight, into the NF4 shard ``target`` (collective)."""
    local = local_shard(target)
    rows = rows.to(device=local.quantized_data.device, dtype=local.dtype).contiguous()
    group = None  # the group over which the rows are split (None: every rank holds all of them)
    if isinstance(target, DTensor):
        dims = [d for d, p in enumerate(target.placements) if isinstance(p, Shard) and target.device_mesh.size(d) > 1]
        group = target.device_mesh.get_group(dims[0]) if dims else None
    parts = quantize_rows(rows, local.block_size, local.scaler_block_size, group=group)
    for name, value in parts.items():
        getattr(local, name).copy_(value.reshape(getattr(local, name).shape))
