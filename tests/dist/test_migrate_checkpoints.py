"""FSDP1-written checkpoints (Accelerate's sharded DCP layout, full torch.save files) and DeepSpeed-style
consolidated files load into FSDP2 models at other world sizes with bit-identical weights and Adam state.

FSDP1 saves at 2 ranks; FSDP2 loads at 3 (uneven shards) and at 1. See migrate_world.py.
"""

from __future__ import annotations

import migrate_world
import pytest

from fsdp2kit.testing import run_world

_saved: dict = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    if "root" not in _saved:
        root = tmp_path_factory.mktemp("fsdp1_ckpts")
        run_world(migrate_world.save_fsdp1, 2, str(root), timeout=300)
        _saved["root"] = str(root)
    return _saved["root"]


@pytest.mark.timeout(600)
# make test-all loads at 1 too: the loaders have no world-size branch; 3 ranks (uneven shards) is the harder case
@pytest.mark.parametrize("world", [3, pytest.param(1, marks=pytest.mark.slow)])
def test_fsdp1_checkpoints_load_bitwise(saved: str, world: int) -> None:
    ranks = run_world(migrate_world.load_world, world, saved, timeout=300)
    for rank, out in enumerate(ranks):
        layouts = out["compare"]
        # both variants, every layout (accelerate's own save when it is installed)
        assert {"flat/sharded", "flat/full", "flat/sharded-meta", "flat/zero_to_fp32"} <= set(layouts)
        assert "orig_tied_groups/full/refused" in layouts
        for layout, problems in layouts.items():
            assert problems == [], f"rank {rank} of {world}, {layout}: {problems[:5]}"
        errors = out["errors"]
        assert "pass its parent" in errors["optimizer dir instead of its parent"]
        assert "holds no optimizer state" in errors["weights-only dir with optimizer"]
