"""2,000 steps of the demo recipe with a checkpoint every 100: no memory, file-descriptor or thread growth."""

from __future__ import annotations

import pytest
from soak import markdown, problems, run_soak


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_a_long_run_with_checkpoints_leaks_nothing(tmp_path):
    result = run_soak(tmp_path, steps=2000, every=100)
    assert not problems(result), markdown(result)
