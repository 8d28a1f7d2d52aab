"""Model FLOPs per token: a tied output head is a matmul, an embedding lookup is not."""

from __future__ import annotations

import torch
from models import TinyGPT

from fsdp2kit.mfu import peak_flops, transformer_flops_per_token


def test_tied_head_counts_like_an_untied_one():
    torch.manual_seed(0)
    untied, tied = TinyGPT(), TinyGPT(tied=True)
    args = (3, 40, 16)  # layers, hidden, seq of TinyGPT's defaults
    assert sum(p.numel() for p in tied.parameters()) < sum(p.numel() for p in untied.parameters())
    # Same matmuls either way: the head (vocab x hidden) is counted once, the lookup never.
    assert transformer_flops_per_token(tied, *args) == transformer_flops_per_token(untied, *args)
    head = untied.head.weight.numel()
    plain = transformer_flops_per_token(torch.nn.Sequential(untied.trunk, untied.norm), *args)
    assert transformer_flops_per_token(untied, *args) == plain + 6.0 * (head + untied.pos.numel())


def test_no_peak_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_peak_by_card_name(monkeypatch):
    from fsdp2kit.planner.hardware import GPUS

    # the planner's presets, and the cards it has none for; the longest name that matches wins (PCIe over H100)
    for name, peak in [
        ("NVIDIA H100 80GB HBM3", GPUS["h100"].bf16_flops),
        ("NVIDIA B200", GPUS["b200"].bf16_flops),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA L40S", 362e12),
        ("Tesla T4", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda")) == peak, name
