"""The recipe's [lora] table: LoRA or QLoRA adapters on the model, before sharding."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import fsdp2kit as fk


def split_targets(targets: str) -> str | list[str]:
    """``"all-linear"`` or a comma-separated list of module names, as the table spells them."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    if not names:
        raise ValueError("[lora] targets is empty: name the Linear modules to adapt, or 'all-linear'")
    return "all-linear" if names == ["all-linear"] else names


def apply_lora_table(
    model: nn.Module, *, r: int, alpha: float, dropout: float, targets: str, qlora: bool, dtype: torch.dtype
) -> nn.Module:
    """The base frozen at ``dtype`` (4-bit NF4 blocks with ``qlora``), fp32 adapters from peft.

    Returns the peft model that replaces ``model`` in the rest of the recipe.
    """
    # The parameters only, in place (ties kept; free on the meta device): ``model.to(dtype)`` would
    # also cast the fp32 buffers, e.g. RoPE's inv_freq, which from_pretrained(dtype=bf16) keeps
    # in fp32; a bf16 inv_freq shifts every rotary angle and the logits with them.
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    if qlora:
        fk.quantize_nf4(model)
    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` alias when it wraps the model; the
        # FutureWarning is about peft's code, printed on every rank at every launch. Here only, not process-wide.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return fk.apply_lora(model, r=r, alpha=alpha, dropout=dropout, targets=split_targets(targets))
