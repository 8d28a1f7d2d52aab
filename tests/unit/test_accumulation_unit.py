"""fk.accumulate's and check_accumulation's refusals, before any collective.

The policies themselves run in tests/dist/test_parity.py.
"""

from __future__ import annotations

import pytest
import torch.nn as nn

import fsdp2kit as fk
from fsdp2kit.accumulation import check_accumulation


@pytest.mark.timeout(30)
def test_refusals() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="expected one of"), fk.accumulate(model, "sometimes", 0, 2):
        pass
    with pytest.raises(ValueError, match="micro=2: expected"), fk.accumulate(model, "no_sync", 2, 2):
        pass
    with pytest.raises(ValueError, match="n_micro=0"), fk.accumulate(model, "no_sync", 0, 0):
        pass
    with (
        pytest.raises(ValueError, match="^accumulate: Linear has no FSDP units"),
        fk.accumulate(model, "no_sync", 0, 2),
    ):
        pass
    with pytest.raises(ValueError, match="^no_sync: Linear has no FSDP units"), fk.no_sync(model):
        pass


@pytest.mark.timeout(30)
def test_defer_all_reduce_needs_hsdp(mesh) -> None:
    assert check_accumulation("defer_all_reduce", hsdp=True) == "defer_all_reduce"
    with pytest.raises(ValueError, match="needs an HSDP mesh"):
        check_accumulation("defer_all_reduce", hsdp=False)
    with pytest.raises(ValueError, match="needs an HSDP mesh"):
        check_accumulation("keep_gathered_defer_all_reduce", hsdp=False)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fk.shard_model(model, mesh, blocks=[nn.Linear])  # a 1-D mesh: accumulate finds no replicate dimension
    with pytest.raises(ValueError, match="needs an HSDP mesh"), fk.accumulate(model, "defer_all_reduce", 0, 2):
        pass
