"""Model FLOPs utilisation: a transformer's training FLOPs per token, and a device's dense bf16 peak."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["peak_flops", "transformer_flops_per_token"]

# Dense bf16 peak FLOP/s (without sparsity) of the cards the planner has no preset for (fsdp2kit.planner.hardware
# holds the rest); MFU is reported only for cards named in either. The PCIe H100 is lower than the SXM preset.
_OTHER_PEAK_BF16 = {"H100 PCIe": 756e12, "L40S": 362e12, "A10G": 70e12, "4090": 165e12}


def transformer_flops_per_token(model: nn.Module, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (the PaLM appendix formula): 6 per parameter but embedding tables (unless a
    head shares one), plus attention's ``12 * layers * hidden * seq_len``."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    tables = [m.weight for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in linear_weights]
    n = sum(p.numel() for p in model.parameters()) - sum(t.numel() for t in tables)
    return 6.0 * n + 12.0 * n_layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None when unknown (CPUs: MFU is not reported)."""
    if device.type != "cuda":
        return None
    from fsdp2kit.planner.hardware import GPUS

    peaks = {k.upper(): gpu.bf16_flops for k, gpu in GPUS.items()} | _OTHER_PEAK_BF16
    name = torch.cuda.get_device_name(device)
    matches = [k for k in peaks if k in name]
    return peaks[max(matches, key=len)] if matches else None
