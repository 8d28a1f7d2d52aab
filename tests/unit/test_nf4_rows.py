"""NF4 from rows: the meta placeholder's layout and the row quantizer against torchao's to_nf4, bit for bit."""

from __future__ import annotations

import pytest
import torch

from fsdp2kit.weights.nf4 import NF4_INNER_TENSORS, meta_nf4, quantize_rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups,shape", [((64, 256), (256, 512)), ((32, 8), (64, 128))])
def test_rows_and_placeholder_match_to_nf4(dtype, groups, shape) -> None:
    from torchao.quantization import to_nf4

    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.1
    ref = to_nf4(w, *groups)
    # One rank holding every row (no group): the mean is its own, so this is to_nf4 itself.
    got = quantize_rows(w, *groups)
    placeholder = meta_nf4(w.shape, dtype, *groups)
    assert sorted(NF4_INNER_TENSORS) == sorted(ref.__tensor_flatten__()[0])  # fsdp2kit's names are torchao's
    for name in NF4_INNER_TENSORS:
        want = getattr(ref, name)
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
        meta = getattr(placeholder, name)
        assert meta.is_meta and meta.dtype == want.dtype and meta.shape == want.shape, name
    assert (placeholder.n_blocks, placeholder.stride(), placeholder.dtype) == (ref.n_blocks, ref.stride(), ref.dtype)
