"""The memory planner against measurement: every category it reports, on real gloo ranks (CPU).

Each case trains a tiny Llama with fsdp2kit (as the recipe does) and measures one step after a
warm-up with `fsdp2kit.planner.measure.measure_step` (live tensor storage bytes at every op, by
category); `fsdp2kit.plan_memory(..., device="cpu")` predicts the same figures from the model
built on the meta device. The planner replays what FSDP2 allocates, so on CPU it is expected to
be exact up to the optimizer's step counters and a few small tensors: the bar is 2% (the
17-configuration grid is within 1.2% on every category), far inside the issue's 10%.
benchmarks/memory_planner_check.py runs the full grid.
"""

from __future__ import annotations

import pytest
from memory_planner_check import measure_world, predict

from fsdp2kit.testing import run_world

CASES = [
    dict(world=2, replicate=1, ac=None, mp=None, batch=2, seq=64, size="s"),
    dict(world=2, replicate=1, ac="full", mp="bf16", batch=2, seq=96, size="s"),
    dict(world=2, replicate=1, ac="selective", mp=None, batch=1, seq=64, size="deep", optimizer="sgd"),
]


def _close(predicted: int, measured: int, what: str, rel: float = 0.02) -> None:
    assert abs(predicted - measured) <= rel * max(measured, 1) + 64, (
        f"{what}: predicted {predicted}, measured {measured}"
    )


@pytest.mark.timeout(300)
def test_every_category_matches_a_measured_step():
    ranks = run_world(measure_world, 2, CASES, timeout=280)
    for i, case in enumerate(CASES):
        measured = max((r[i] for r in ranks), key=lambda m: m["peak"])
        plan = predict(case)
        label = str(case)
        _close(plan.peak_bytes, measured["peak"], f"{label} peak")
        assert plan.phase == measured["phase"], label
        _close(plan.parts["params"], measured["params"], f"{label} sharded parameters")
        _close(plan.measured_like["grads"], measured["grads"], f"{label} gradients")
        _close(plan.parts["optimizer"], measured["optimizer"], f"{label} optimizer state")
        _close(plan.measured_like["max_gathered"], measured["max_gathered"], f"{label} gathered parameters")
        _close(plan.measured_like["max_comm_buffers"], measured["max_comm_buffers"], f"{label} FSDP buffers")
        _close(plan.saved_activations, measured["saved_activations"], f"{label} saved activations")
        _close(plan.logits_and_loss, measured["logits_and_loss"], f"{label} logits and loss")
        # At the peak: the parts the measurement can tell apart by identity.
        for part in ("params", "optimizer", "gathered", "grads"):
            _close(plan.parts[part], measured["parts"][part], f"{label} {part} at the peak")
        rest = sum(plan.parts[k] for k in ("unsharded_grads", "activations", "temporaries", "comm_buffers"))
        _close(rest, measured["parts"]["rest"] + measured["parts"]["comm_buffers"], f"{label} the rest at the peak")
