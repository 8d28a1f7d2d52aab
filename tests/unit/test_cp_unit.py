"""Context parallelism without a process group: the sequence layout, document masks, the FSDP view of a cp mesh."""

from __future__ import annotations

import pytest
import torch

from fsdp2kit.dist import fsdp_mesh_shape
from fsdp2kit.parallel.cp_inputs import _split, chunk_order, document_mask


def test_chunk_order_pairs_head_and_tail() -> None:
    assert chunk_order(1) == [0, 1]
    assert chunk_order(2) == [0, 3, 1, 2]
    assert chunk_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]


@pytest.mark.parametrize("cp", [2, 4])
def test_split_is_load_balanced_and_covers_the_sequence(cp: int) -> None:
    seq = torch.arange(8 * cp).view(1, -1)
    parts = [_split(seq, cp, r, 1, "ids") for r in range(cp)]
    # every token exactly once, in the layout order
    assert torch.equal(torch.cat(parts, dim=1).sort().values, seq)
    n = seq.shape[1] // (2 * cp)
    for r, part in enumerate(parts):
        assert part[0, :n].tolist() == list(range(r * n, (r + 1) * n))
        tail = 2 * cp - 1 - r
        assert part[0, n:].tolist() == list(range(tail * n, (tail + 1) * n))
    # causal work (keys each token attends to) is equal on every rank
    work = [int((p + 1).sum()) for p in parts]
    assert len(set(work)) == 1, work


def test_split_refuses_a_sequence_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="does not divide into 2 x cp = 4 equal chunks.*seq_len 8"):
        _split(torch.zeros(2, 6), 2, 0, 1, "ids")


def test_document_mask_keeps_packed_documents_apart() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    mask = document_mask(pos)[0, 0]
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    for i in range(8):
        for j in range(8):
            assert bool(mask[i, j]) == (doc[i] == doc[j] and j <= i), (i, j)


def test_document_mask_none_for_one_document_per_row() -> None:
    # one document per row (positions may start past 0: a continued document): the causal flag suffices
    assert document_mask(torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])) is None
    # not causal: the document mask is still built
    assert document_mask(torch.tensor([[0, 1, 2, 3]]), causal=False).all()


def test_fsdp_view_folds_cp_into_shard() -> None:
    assert fsdp_mesh_shape((2, 2), ("shard", "cp")) == ((4,), ("shard_cp",))
    names = ("replicate", "shard", "cp", "tp")
    assert fsdp_mesh_shape((2, 1, 2, 2), names) == ((2, 2, 2), ("replicate", "shard_cp", "tp"))
    assert fsdp_mesh_shape((2, 4), ("replicate", "shard")) == ((2, 4), ("replicate", "shard"))


def test_recipe_refuses_a_seq_len_cp_cannot_split() -> None:
    # before any process group: a config error that names the seq_len that works
    from train import check_before_start

    from support.config import parse_config
    from support.errors import ConfigError
    from support.options import Config

    cfg = parse_config(Config, ["--parallel.cp", "4", "--data.seq_len", "66"], prog="train.py")
    with pytest.raises(
        ConfigError, match=r"seq_len 66 with parallel.cp 4 does not divide into 2 x cp = 8 .*seq_len 72"
    ):
        check_before_start(cfg)


def test_recipe_refuses_what_the_ring_cannot_run() -> None:
    from train import check_before_start

    from support.config import parse_config
    from support.errors import ConfigError
    from support.options import Config

    ring = ["--parallel.cp", "2", "--parallel.cp_style", "ring", "--data.seq_len", "192"]
    for extra, message in (([], "got packed rows"), (["--data.packing", "false"], "64 x cp = 128 tokens, got 192")):
        with pytest.raises(ConfigError, match=message):
            check_before_start(parse_config(Config, ring + extra, prog="train.py"))


def test_ring_refuses_what_it_cannot_run_before_any_collective() -> None:
    from fsdp2kit.parallel.context_parallel import _ring

    ring = _ring(None, 2)  # no process group: each refusal comes before the positions' all-gather
    module = torch.nn.Module()
    module.is_causal = True
    pos = torch.arange(64)[None]
    q = torch.zeros(1, 4, 64, 8)
    for kw in (dict(softcap=30.0), dict(s_aux=torch.zeros(4))):
        with pytest.raises(ValueError, match=f"style='ring' has no {next(iter(kw))}"):
            ring(module, q, q, q, None, position_ids=pos, **kw)
    meta = torch.zeros(1, 4, 96, 8, device="meta")  # not CPU: the CUDA kernel's 32-token padding applies
    with pytest.raises(ValueError, match=r"divide by 64 x cp = 128 tokens, got 192"):
        ring(module, meta, meta, meta, None, position_ids=pos)


def test_mask_cache_is_per_batch_size() -> None:
    # One (1, seq) position_ids tensor broadcast over batches of 2, then 3 rows: the second mask has 3 rows
    from fsdp2kit.parallel.context_parallel import _Positions

    cache = _Positions()
    pos = torch.tensor([[0, 1, 0, 1]])
    masks = [cache.get(pos, b, lambda b=b: pos.expand(b, -1), document_mask) for b in (2, 3, 3)]
    assert [m.shape[0] for m in masks] == [2, 3, 3]
    assert masks[2] is masks[1]  # the same batch again: the cached mask
