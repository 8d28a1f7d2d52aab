"""The multi-process harness itself: results in rank order, every rank's error, hangs bounded."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fsdp2kit.testing import WorldError, run_world


def _whoami(tag: str) -> tuple[str, int, int]:
    t = torch.ones(1)
    dist.all_reduce(t)
    return tag, dist.get_rank(), int(t.item())


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise KeyError("rank one is unhappy")
    dist.barrier()  # rank 0 would wait here forever: the harness must not


def _rank1_hangs() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)


@pytest.mark.timeout(120)
def test_results_in_rank_order():
    out = run_world(_whoami, 3, "x")
    assert out == [("x", 0, 3), ("x", 1, 3), ("x", 2, 3)]


@pytest.mark.timeout(120)
def test_one_rank_failing_is_reported_and_the_rest_are_stopped():
    start = time.monotonic()
    with pytest.raises(WorldError) as err:
        run_world(_rank1_raises, 2, timeout=100, grace=3)
    text = str(err.value)
    assert "--- rank 1 ---" in text and "KeyError: 'rank one is unhappy'" in text
    assert time.monotonic() - start < 60  # not the 100 s deadline: the waiting rank was killed


@pytest.mark.slow  # make test-all: keeps make test near 10 minutes
@pytest.mark.timeout(120)
def test_a_hang_fails_within_the_deadline():
    start = time.monotonic()
    with pytest.raises(WorldError, match=r"ranks \[1\] did not finish within the deadline"):
        run_world(_rank1_hangs, 2, timeout=12)  # rank 0 starts and returns in a few seconds, even in CI
    assert time.monotonic() - start < 40
