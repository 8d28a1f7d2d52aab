"""QLoRA from a meta model: load_pretrained quantizes each rank's rows into NF4 shards equal to the eager path's."""

from __future__ import annotations

import pytest
from qlora_load_cases import run_cases

from fsdp2kit.testing import run_world


def _check(res: dict) -> None:
    assert res["compared"] > 0
    assert not res["mismatch"], f"NF4 shards differ from quantize-then-shard: {res['mismatch'][:6]}"
    for dtype, same in res["logits"].items():
        assert same, f"{dtype}: logits differ by {res['logits_diff_' + dtype]:.2e}"


@pytest.mark.timeout(200)
def test_meta_qlora_world2(tmp_path) -> None:
    ranks = run_world(run_cases, 2, str(tmp_path), -1, 1, True, timeout=180)
    for res in ranks:
        _check(res)
        errors = res["errors"]
        assert "load_pretrained" in errors["materialize"], errors["materialize"]
        assert "do not split evenly over 2 ranks" in errors["uneven"], errors["uneven"]
        assert "NF4" in errors["tp"] and "tensor parallel" in errors["tp"], errors["tp"]
        assert "NF4 weights missing from the checkpoint" in errors["missing"], errors["missing"]
        assert "layers.0.self_attn.q_proj.weight" in errors["missing"], errors["missing"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_meta_qlora_hsdp_2x2(tmp_path) -> None:
    for res in run_world(run_cases, 4, str(tmp_path), 2, 2, False, timeout=280):
        _check(res)
