"""Non-finite steps and desyncs on real gloo ranks: every rank gets the same verdict, naming the module or rank."""

from __future__ import annotations

import time

import diagnostics_world as world
import pytest

from fsdp2kit.testing import run_world


@pytest.mark.timeout(240)
def test_nonfinite_raises_or_skips_alike_on_every_rank():
    results = run_world(world.nonfinite_cases, 2)
    for out in results:
        assert out["healthy"] is True
        assert out["norm_is_nan"] and out["downstream_finite_after_clip"]
        message, step, module = out["raise"]
        # NaN entered at trunk[1]'s output: its last module in forward order is the first in backward.
        assert step == 7 and module == "trunk.1.fc2", message
        assert "step 7: non-finite gradient norm" in message and "'trunk.1.fc2'" in message
        assert "trunk.2" not in message and "head" not in message  # downstream gradients stayed finite
        assert out["skip_returned"] is False and out["grads_dropped"] and out["params_unchanged"]
        message, module = out["loss_only"]
        assert "non-finite loss on rank 0" in message and module is None, message
    assert results[0]["raise"][0] == results[1]["raise"][0]  # the same message on every rank


@pytest.mark.timeout(240)
def test_positions_are_tracked_and_a_skipped_micro_step_is_named():
    results = run_world(world.monitor_cases, 2)
    for out in results:
        phases = out["phases"]
        # the FSDP hooks mark each unit's collectives and compute, in the order they happen
        for expected in [
            ("all-gather", "trunk.0"),
            ("forward", "trunk.0"),
            ("backward all-gather", "trunk.2"),
            ("backward", "trunk.2"),
            ("reduce-scatter", "trunk.2"),
            ("optimizer", ""),
        ]:
            assert expected in phases, (expected, phases[:20])
        order = [phases.index(p) for p in [("all-gather", "trunk.0"), ("forward", "trunk.0")]]
        assert order == sorted(order)
        bwd = [phases.index(p) for p in [("backward all-gather", "trunk.1"), ("backward", "trunk.1")]]
        assert bwd == sorted(bwd) and phases.index(("reduce-scatter", "trunk.2")) < bwd[0]

        message, diverged, seconds = out["skip"]
        assert diverged == [1], message
        assert "ranks disagree at a check" in message and "rank 1: step 2, micro-step 1 of 2" in message
        assert "<- diverged" in message.splitlines()[-1] and seconds < 15, message  # at once, no timeout
    assert results[0]["skip"][0].split(":", 1)[1] == results[1]["skip"][0].split(":", 1)[1]


@pytest.mark.timeout(120)
def test_a_rank_stuck_in_a_collective_is_reported_within_the_short_timeouts():
    start = time.monotonic()
    results = run_world(world.hang_case, 2, timeout=90)
    elapsed = time.monotonic() - start
    early, stuck = results[1]["error"], results[0]["error"]
    # rank 1 waited at step 2's first check (3 s), rank 0 in an all-gather (8 s): both name rank 1
    message, diverged, _ = early
    assert diverged == [1] and "did not all reach the check within 3 s" in message, message
    assert "rank 1: step 2, micro-step 0 of 2, check, batch [2, 17] (its previous step had 1 micro-step)" in message
    assert "rank 0: step 1, micro-step 1 of 2, all-gather" in message, message
    message, diverged, seconds = stuck
    assert diverged == [1] and "a collective failed" in message and seconds < 30, message
    assert "rank 0: step 1, micro-step 1 of 2, all-gather" in message, message
    assert elapsed < 80  # far below the default 10-minute collective timeout
