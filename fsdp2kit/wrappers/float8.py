"""Float8 training through torchao, with float8 all-gather of weights under FSDP2 (docs/internals.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp2kit._internal.fmt import fmt_list
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit.blocks import BlockSpec, find_blocks, shared_parameters
from fsdp2kit.wrappers.forward import check_order

__all__ = ["enable_float8"]

_MULTIPLE = 16  # torch._scaled_mm needs both matmul dimensions divisible by 16


def _refresh_scales(layers: list[nn.Module]) -> Callable:
    """A forward pre-hook: recompute the float8 weight scales (one all-reduce) when any weight's version changed;
    every rank runs the same optimizer steps, so every rank takes the same branch."""
    seen: list[tuple[int, int]] = []

    def hook(module: nn.Module, args) -> None:
        from torch.distributed.tensor import DTensor
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        # Sharded weights only: a unit that was not resharded after its last forward (FSDP2 keeps
        # the last block gathered after a forward without backward) is skipped here and by
        # torchao, and its scale is refreshed once it is sharded again (its identity joins the key).
        # None sharded (yet): Float8Linear computes each scale in its forward.
        weights = [layer.weight for layer in layers if isinstance(layer.weight, DTensor)]
        versions = [(id(w), w._version) for w in weights]
        if weights and versions != seen:
            precompute_float8_dynamic_scale_for_fsdp(module)
            seen[:] = versions

    return hook


def _check_tokens(module: nn.Module, args) -> None:
    """Forward pre-hook of a float8 Linear: on CUDA the tokens must be a multiple of 16 (the weight gradient's
    ``_scaled_mm`` runs over them), said in user terms, not as a shape error in backward."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.is_cuda and x.dim() >= 2:
        tokens = x.numel() // x.shape[-1]
        if tokens % _MULTIPLE:
            raise ValueError(
                f"float8 training needs the tokens per rank and micro-batch (batch x sequence) to be a multiple of "
                f"{_MULTIPLE} on CUDA (torch._scaled_mm's shapes); this forward has {tokens}: pad the sequence or "
                "change the micro-batch"
            )


def enable_float8(
    model: nn.Module,
    fsdp_all_gather: bool = True,
    *,
    blocks: BlockSpec = "auto",
    filter_fn: Callable[[nn.Linear, str], bool] | None = None,
) -> nn.Module:
    """Swap the eligible Linear layers of ``model``'s blocks for torchao float8 ones, in place; returns ``model``.

    Call it first: before `apply_activation_checkpointing`, `compile_blocks` and `shard_model`.
    ``fsdp_all_gather``: all-gather weights in float8 (a quarter of fp32's bytes), their scales kept up to
    date. ``blocks`` as for `shard_model`: only Linear layers inside them are converted, narrowed further by
    ``filter_fn(linear, qualified_name)``. Raises ``ValueError`` if no layer is eligible (float8 silently
    doing nothing is worse than an error).
    """
    with quiet_imports():  # torchao's import-time log lines on a CPU build (fsdp2kit._internal.quiet)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

    if not isinstance(fsdp_all_gather, bool):
        raise ValueError(f"fsdp_all_gather={fsdp_all_gather!r}: expected True or False")
    if any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError("enable_float8: this model already has float8 Linear layers; call it once")
    check_order(model, "enable_float8")
    found = find_blocks(model, blocks)

    tied = set(shared_parameters(model))
    in_blocks = {id(m) for block in found for m in block.modules()}
    chosen: set[int] = set()
    skipped: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or id(module) not in in_blocks:
            continue
        eligible = module.in_features % _MULTIPLE == 0 and module.out_features % _MULTIPLE == 0
        if not eligible or any(id(p) in tied for p in module.parameters(recurse=False)):
            skipped.append(name)
        elif filter_fn is None or filter_fn(module, name):
            chosen.add(id(module))
    if not chosen:
        raise ValueError(
            "enable_float8: no Linear layer is eligible for float8 (one in the blocks, both dimensions multiples of "
            f"{_MULTIPLE}, no tied weight{', accepted by filter_fn' if filter_fn else ''}); the blocks' ineligible "
            f"ones: {fmt_list(skipped, 3) or 'none'}"
        )

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: id(m) in chosen, config=config)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for layer in layers:
        layer.register_forward_pre_hook(_check_tokens)
    if fsdp_all_gather:
        model.register_forward_pre_hook(_refresh_scales(layers))
    return model
