"""The model as training changes it, on the meta device (docs/memory_planner.md, "Tensor parallelism, LoRA, QLoRA")."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp2kit.planner.trace import meta_copy

__all__ = ["lora_model", "trained_model"]


def lora_model(
    model: nn.Module,
    *,
    r: int,
    qlora: bool,
    targets: str | tuple[str, ...] = "all-linear",
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """A meta copy of ``model`` as the recipe's ``[lora]`` table makes it: the base in bf16 under bf16 compute, else
    fp32, block Linears in NF4 with ``qlora``, rank-``r`` fp32 peft adapters on ``targets``."""
    from fsdp2kit.weights.adapters import apply_lora
    from fsdp2kit.weights.nf4 import quantize_nf4

    work = meta_copy(model, torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32)
    if qlora:  # on the meta device: NF4 placeholders with to_nf4's inner tensors (fsdp2kit.weights.nf4.meta_nf4)
        quantize_nf4(work)
    # peft's adapter init draws from the CPU generator even on meta tensors: a plan must leave the
    # caller's stream as it was (the recipe planned on rank 0 only, so its ranks' streams parted).
    with torch.random.fork_rng(devices=[]):
        return apply_lora(work, r=r, targets=list(targets) if isinstance(targets, tuple) else targets)


def trained_model(
    model: nn.Module, *, lora: int | None, qlora: bool, targets, tp: int, compute_dtype: torch.dtype | None
) -> nn.Module:
    """``model`` as the run trains it: with rank-``lora`` adapters (`lora_model`), then as one rank of
    ``apply_tensor_parallel(model, mesh, "auto")`` holds it (local shapes, the vocabulary-split head gathering)."""
    from fsdp2kit.parallel.tensor_parallel import planned_tp_shapes

    if lora is not None:
        model = lora_model(model, r=lora, qlora=qlora, targets=targets, compute_dtype=compute_dtype)
    if tp == 1:
        return model
    shapes = planned_tp_shapes(model, tp)
    work = meta_copy(model, None, shapes=shapes)
    if callable(getattr(model, "get_output_embeddings", None)):  # then its deep copy ``work`` has it too
        head, original = work.get_output_embeddings(), model.get_output_embeddings()
        if isinstance(head, nn.Linear) and original is not None and id(original.weight) in shapes:
            # "colwise_gather_output": every TP rank ends with the whole vocabulary's logits (tp slices' bytes).
            head.register_forward_hook(lambda module, args, output: torch.cat([output] * tp, dim=-1))
    return work
