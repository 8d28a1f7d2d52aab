"""`load_pretrained`'s zero-copy CPU path (shards as views of a private file mapping) against its copying path.

One world of 2 gloo ranks: the same checkpoint loaded both ways must give the same shard bits,
and AdamW training afterwards the same losses and shards bit for bit, while the file stays
untouched (the mapping is copy-on-write). A bf16 file into fp32 parameters is never mapped.
"""

from __future__ import annotations

import pytest
import torch
from mapped_world import compare, save

from fsdp2kit.testing import run_world


@pytest.mark.timeout(240)
def test_mapped_load_matches_copying_load(tmp_path):
    paths = [save(tmp_path, 96, torch.float32), save(tmp_path, 97, torch.float32), save(tmp_path, 96, torch.bfloat16)]
    ranks = run_world(compare, 2, [str(p) for p in paths], 3, timeout=200)
    for rank, cases in enumerate(ranks):
        even, uneven, bf16 = cases
        for case in cases:
            where = f"rank {rank} {case['path']}"
            assert case["load_differs"] == [], where
            assert case["trained_differs"] == [], where
            assert case["losses_mapped"] == case["losses_copied"], where
            assert case["file_unchanged"], where
            assert case["copy_bytes_mapped"] == 0 and case["copy_file_backed"] == 0, where
        # fp32 file into fp32 shards: every shard is a view of the mapping, nothing is read
        assert even["file_backed"] == even["params"] and even["bytes_read"] == 0, even
        assert even["bytes_mapped"] > 0
        # vocab 97 at 2 ranks: rank 1's embedding and lm_head rows are padded by FSDP (a copy), the rest mapped
        expected = even["params"] - (2 if rank == 1 else 0)
        assert uneven["file_backed"] == expected, uneven
        # a dtype cast is never mapped: read and cast as before
        assert bf16["bytes_mapped"] == 0 and bf16["file_backed"] == 0 and bf16["bytes_read"] > 0, bf16
