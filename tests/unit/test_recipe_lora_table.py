"""The recipe's [lora] table casts the base's parameters, not its buffers, and keeps ties."""

from __future__ import annotations

import pytest
import torch
from models import tiny_llama

from support.lora import apply_lora_table


@pytest.mark.timeout(60)
def test_lora_table_casts_parameters_only() -> None:
    with torch.device("meta"):
        model = tiny_llama(tied=True, hidden=256, intermediate=512)
    model = apply_lora_table(
        model, r=4, alpha=8, dropout=0.0, targets="q_proj,v_proj", qlora=True, dtype=torch.bfloat16
    )  # fmt: skip
    # RoPE's inv_freq stays fp32, as from_pretrained(dtype=bfloat16) leaves it.
    assert {b.dtype for _, b in model.named_buffers()} == {torch.float32}
    base = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert base == {torch.bfloat16} and {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {
        torch.float32
    }
    inner = model.get_base_model()
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    assert sum(type(p).__name__ == "NF4Tensor" for p in model.parameters()) == 7 * 3  # every Linear of the 3 blocks
