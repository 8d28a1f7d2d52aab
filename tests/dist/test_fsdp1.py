"""wrap_fsdp1 trains to the same parameters as one process on the concatenated batch.

The benchmark's FSDP1 variants are only a fair comparison if they compute the same thing as
the FSDP2 ones; this is the FSDP1 side of that (parity.py is the FSDP2 side). One spawn runs
every case.
"""

from __future__ import annotations

import pytest
from fsdp1_cases import Fsdp1Case, run_cases

from fsdp2kit.testing import run_world

RTOL = 1e-5

CASES = [
    Fsdp1Case(model="llama", strategy="FULL_SHARD"),
    Fsdp1Case(model="llama", strategy="SHARD_GRAD_OP", optim="sgd", forward_prefetch=True),
    Fsdp1Case(model="tinygpt", strategy="NO_SHARD"),
    Fsdp1Case(model="tinygpt", use_orig_params=True),
    Fsdp1Case(model="llama-tied", optim="sgd"),
]
# blocks + embedding + root; a tied embedding stays in the root (one FSDP1 unit is one module)
UNITS = {"llama": 3 + 2, "tinygpt": 3 + 2, "llama-tied": 3 + 1}

_results: list | None = None


def _ranks() -> list[list[dict]]:
    global _results
    if _results is None:
        _results = run_world(run_cases, 2, CASES, timeout=300)
    return _results


@pytest.mark.timeout(360)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.label for c in CASES])
def test_fsdp1_parity(index: int, parity_table) -> None:
    ranks = _ranks()
    res = ranks[0][index]
    parity_table.append((res["label"], 2, res["worst_rel"], res["worst_param"]))
    assert res["n_params"] == res["n_ref_params"]
    assert res["n_units"] == UNITS[CASES[index].model]
    assert res["worst_rel"] < RTOL, f"{res['label']}: {res['worst_param']} differs by {res['worst_rel']:.2e}"
    assert res["losses"] == pytest.approx(res["ref_losses"], rel=RTOL)
    assert ranks[1][index]["losses"] == res["losses"]
