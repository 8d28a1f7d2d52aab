"""The model as training will change it, built on the meta device: LoRA adapters, an NF4 base, a TP rank's slices.

The planner then records and replays this model like any other, so a LoRA, QLoRA or
tensor-parallel plan is traced (what autograd saves, the dequantized NF4 weights, the gathered
logits) rather than scaled from a full-training one. Each step does what the recipe's does:
`fsdp2kit.quantize_nf4` before `fsdp2kit.apply_lora` (recipes/support/lora.py), and
`fsdp2kit.apply_tensor_parallel`'s ``"auto"`` plan (its shapes from ``planned_tp_shapes``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from fsdp2kit.blocks import find_blocks
from fsdp2kit.planner.trace import meta_copy
from fsdp2kit.weights.nf4 import NF4_DEFAULTS

__all__ = ["lora_model", "meta_nf4", "tp_local_model"]


def meta_nf4(shape: torch.Size, dtype: torch.dtype, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """A torchao NF4Tensor of ``shape`` on the meta device: its inner tensors sized as ``to_nf4`` makes them.

    4-bit codes two a byte, one int8 scaler per ``block_size`` values, one factor (in ``dtype``)
    per ``block_size * scaler_block_size``, the scalers' mean and the 16-entry NF4 table.
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    numel = shape.numel()
    n_blocks = numel // block_size
    meta = SubclassTensorArgs(shape, torch.empty(shape, device="meta").stride(), 0, dtype, torch.device("meta"), False)

    def empty(n, dt):
        return torch.empty(n, dtype=dt, device="meta")

    return NF4Tensor(
        meta,
        block_size,
        n_blocks,
        scaler_block_size,
        empty(n_blocks, torch.int8),  # quantized_scalers
        empty(n_blocks // scaler_block_size, dtype),  # quantization_factor
        empty((), dtype),  # scaler_mean
        empty(numel // 2, torch.uint8),  # quantized_data
        empty(16, dtype),  # the NF4 table
    )


def lora_model(model: nn.Module, *, r: int, qlora: bool, base_dtype: torch.dtype) -> nn.Module:
    """A meta copy of ``model`` with its base in ``base_dtype`` (NF4 block Linears with ``qlora``) and
    rank-``r`` peft adapters on every Linear but the head (``apply_lora``'s ``"all-linear"``), fp32."""
    from fsdp2kit.weights.adapters import apply_lora

    work = meta_copy(model, base_dtype)
    if qlora:
        # quantize_nf4's rule: a weight whose size is not a whole number of groups stays as it is.
        group = NF4_DEFAULTS["block_size"] * NF4_DEFAULTS["scaler_block_size"]
        for block in find_blocks(work):
            for m in block.modules():
                if isinstance(m, nn.Linear) and m.weight.numel() % group == 0:
                    nf4 = meta_nf4(m.weight.shape, base_dtype, **NF4_DEFAULTS)
                    m.weight = nn.Parameter(nf4, requires_grad=False)
    return apply_lora(work, r=r)


def _gather_output(tp: int, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    # The head's "colwise_gather_output" style: every TP rank ends with the whole vocabulary's
    # logits (torch all-gathers the slices into one new tensor). tp copies of the slice allocate
    # the same bytes on the meta device.
    return torch.cat([output] * tp, dim=-1)


def tp_local_model(model: nn.Module, tp: int) -> nn.Module:
    """A meta copy of ``model`` as one rank of ``apply_tensor_parallel(model, mesh, "auto")`` holds it.

    Split parameters get their local shapes, so attention runs ``heads / tp`` heads and the MLP
    ``intermediate / tp`` columns, as transformers' attention does on a TP rank; row-wise outputs
    (after their all-reduce) and the embedding's output are whole, as on a rank. The output head,
    split over the vocabulary, gathers its logits (the ``"auto"`` plan without ``loss_parallel``).
    """
    from fsdp2kit.parallel.tensor_parallel import planned_tp_shapes

    shapes = planned_tp_shapes(model, tp)
    work = meta_copy(model, None, shapes=shapes)
    get = getattr(work, "get_output_embeddings", None)
    head = get() if callable(get) else None
    original = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if isinstance(head, nn.Linear) and original is not None and id(original.weight) in shapes:
        head.register_forward_hook(functools.partial(_gather_output, tp))
    return work
