"""The memory planner against measurement: every category it reports, on real gloo ranks (CPU).

Each case trains a tiny Llama with fsdp2kit (as the recipe does) and measures one step after a
warm-up with `measure_step` (benchmarks/measure_step.py) (live tensor storage bytes at every op, by
category); `fsdp2kit.plan_memory(..., device="cpu")` predicts the same figures from the model
built on the meta device. The planner replays what FSDP2 allocates, so on CPU it is expected to
be exact up to the optimizer's step counters and a few small tensors: the bar is 2% (the
grid is within 1.5% on every category), far inside the issue's 10%. The second test covers the
paths that change the model before sharding: tensor parallelism, LoRA, QLoRA, an MoE and context
parallelism.
benchmarks/memory_planner_check.py runs the full grid.
"""

from __future__ import annotations

import pytest
from memory_planner_check import measure_world, predict

from fsdp2kit.accumulation import ACCUMULATION
from fsdp2kit.testing import run_world

CASES = [
    dict(world=2, replicate=1, ac=None, mp=None, batch=2, seq=64, size="s"),
    dict(world=2, replicate=1, ac="full", mp="bf16", batch=2, seq=96, size="s"),
    dict(world=2, replicate=1, ac="selective", mp=None, batch=1, seq=64, size="deep", optimizer="sgd"),
    dict(world=2, replicate=1, ac="op", mp="bf16", batch=2, seq=64, size="s"),  # torchtitan's per-op policy
    # Peaks in backward's final callback, in the root's reduce-scatter, where gloo's clone of the fp32
    # input outweighs the bf16 gradients it was copied from (-4% without the clone; +4% with it but
    # the embedding reduced before the root).
    dict(world=2, replicate=1, ac="full", mp="bf16", batch=1, seq=16, size="m"),
]


# The paths that change the model before sharding (`fsdp2kit.planner.adapt`): tensor parallelism
# alone on 2 ranks, LoRA over an fp32 base, QLoRA (NF4 base: its inner tensors are counted, not
# the bf16-sized storage its wrapper reports), and an MoE in fp32 (traced with transformers'
# fallback grouped matmul, which torch's meta kernel does not refuse); and one that changes it
# while sharding: a model built in bf16 under "bf16", cast to fp32 masters shard by shard (the
# bf16 storage must not outlive the cast).
ADAPTED = [
    dict(world=2, replicate=1, ac=None, mp=None, batch=1, seq=32, size="s", tp=2),
    dict(world=2, replicate=1, ac="full", mp=None, batch=1, seq=32, size="s", lora=4),
    dict(world=2, replicate=1, ac=None, mp="bf16", batch=1, seq=16, size="q", lora=4, qlora=True),
    dict(world=2, replicate=1, ac=None, mp=None, batch=1, seq=32, size="moe"),
    dict(world=2, replicate=1, ac=None, mp="bf16", batch=2, seq=64, size="s", built="bfloat16"),
    # Context parallelism (all-to-all style) over the 2 ranks: the all-to-all buffers, the attention
    # output held twice, the whole batch beside this rank's part; without AC and with full AC in bf16.
    dict(world=2, replicate=1, ac=None, mp=None, batch=2, seq=64, size="s", cp=2),
    dict(world=2, replicate=1, ac="full", mp="bf16", batch=1, seq=128, size="s", cp=2),
    # Packed rows (two documents): the document mask, seq x seq in fp32, is 7.5% of this peak
    dict(world=2, replicate=1, ac=None, mp=None, batch=1, seq=384, size="s", cp=2, packed=True),
    # Replicated LoRA adapters under bf16: outside FSDP's cast they compute in fp32 (peft casts each adapted
    # Linear's input up, saved for backward): traced in bf16 the peak was 15.6% short.
    dict(world=2, replicate=1, ac=None, mp="bf16", batch=1, seq=32, size="s", lora=4, replicated=True),
]


# Each fk.accumulate policy over 4 micro-batches (the step's peak with what the policy holds between
# them: docs/accumulation.md, "Memory"); the HSDP-only ones on a 2 x 1 mesh. In fp32 no_sync's
# gradients add in place (autograd's), in bf16 they are upcast into a held fp32 sum (FSDP2's). The
# default tier measures one policy of each mechanism (kept parameters with held .grad, a deferred
# all-reduce, in-place sums); the slow tier the rest (about 4.5 s a case).
def _accum(policy: str, **kw) -> dict:
    case = dict(world=2, replicate=2 if "defer" in policy else 1, ac=None, mp="bf16", batch=1, seq=32, size="s")
    return {**case, "accum": 4, "policy": policy, **kw}


# LoRA with replicated adapters (shard_model(..., replicate_adapters=True)): whole adapters, gradients and
# AdamW state on each rank, the .grad added to in place, the flat all-reduce at the end of the last backward.
ACCUM = [
    _accum("keep_gathered"),
    _accum("keep_gathered_defer_all_reduce"),
    _accum("no_sync", ac="full", mp=None),
    _accum("keep_gathered", mp=None, lora=4, replicated=True),
]
ACCUM_SLOW = [_accum(a) for a in ACCUMULATION if a not in ("keep_gathered", "keep_gathered_defer_all_reduce")]
ACCUM_SLOW.append(_accum("regather", ac="full", mp=None, lora=4, replicated=True))


def _near(predicted: int, measured: int, what: str, rel: float = 0.02) -> None:
    assert abs(predicted - measured) <= rel * max(measured, 1) + 64, (
        f"{what}: predicted {predicted}, measured {measured}"
    )


_measured: list[list[dict]] = []


def _ranks() -> list[list[dict]]:
    """Both sets measured in one spawn: process start-up is the slow part."""
    if not _measured:
        _measured.extend(run_world(measure_world, 2, CASES + ADAPTED + ACCUM, timeout=400))
    return _measured


@pytest.mark.timeout(450)
def test_every_category_matches_a_measured_step():
    _check(CASES, [r[: len(CASES)] for r in _ranks()])


@pytest.mark.timeout(450)
def test_tp_lora_qlora_moe_match_a_measured_step():
    _check(ADAPTED, [r[len(CASES) : len(CASES) + len(ADAPTED)] for r in _ranks()])


def _check(cases: list[dict], ranks: list[list[dict]]) -> None:
    for i, case in enumerate(cases):
        measured = max((r[i] for r in ranks), key=lambda m: m["peak"])
        plan = predict(case)
        label = str(case)
        # The MoE case peaks in a block's backward, where the fp32 recording holds 57 KB more
        # than the measured step (the peak +2.1%, the rest at the peak +5.6%); not explained yet
        # (the recording matches a real one-process step; the gap is in the FSDP replay), so its
        # bar is the 10% target, not 2%. docs/memory_planner.md says what is ruled out.
        rel = 0.10 if case["size"] == "moe" else 0.02

        def _close(predicted: int, measured: int, what: str, rel: float = rel) -> None:
            _near(predicted, measured, what, rel)

        _close(plan.peak_bytes, measured["peak"], f"{label} peak")
        # The measurement's label stays at the last block backward reached through the final callback; and
        # where the final callback's peak ties with the last blocks' reduce-scatters (gloo frees their
        # buffers when its thread gets to it), a run can peak in either: the bytes above are checked.
        end = plan.phase == "backward (end)" and measured["phase"].startswith("backward model.layers.")
        assert plan.phase == measured["phase"] or end, label
        _close(plan.parts["params"], measured["params"], f"{label} sharded parameters")
        _close(plan.measured_like["grads"], measured["grads"], f"{label} gradients")
        _close(plan.parts["optimizer"], measured["optimizer"], f"{label} optimizer state")
        _close(plan.measured_like["max_gathered"], measured["max_gathered"], f"{label} gathered parameters")
        _close(plan.measured_like["max_comm_buffers"], measured["max_comm_buffers"], f"{label} FSDP buffers")
        if case.get("tp"):
            # Under TP the split between the two at the last block's output is racy in the
            # measurement: in about 1 of 36 rank-steps one activation-sized tensor (B x S x H) is
            # still alive there and is counted as saved rather than as logits; the peak and the
            # sum are unchanged (the planner predicts the common split). Not traced to its op yet.
            _close(
                plan.saved_activations + plan.logits_and_loss,
                measured["saved_activations"] + measured["logits_and_loss"],
                f"{label} saved activations + logits and loss",
            )
        else:
            _close(plan.saved_activations, measured["saved_activations"], f"{label} saved activations")
            _close(plan.logits_and_loss, measured["logits_and_loss"], f"{label} logits and loss")
        # At the peak: the parts the measurement can tell apart by identity.
        for part in ("params", "optimizer", "grads"):
            _close(plan.parts[part], measured["parts"][part], f"{label} {part} at the peak")
        rest = sum(plan.parts[k] for k in ("unsharded_grads", "activations", "temporaries", "comm_buffers"))
        measured_rest = measured["parts"]["rest"] + measured["parts"]["comm_buffers"]
        if plan.phase == "backward (end)":
            # A peak in backward's final callback races with the root's parameters being freed: in one
            # full run of 2026-11-26 on a loaded machine one gathered parameter (196,800 B) was still
            # alive at it (predicted: freed) while the peak stayed within its 2%. The sum is checked.
            _close(plan.parts["gathered"] + rest, measured["parts"]["gathered"] + measured_rest, f"{label} at the peak")
        else:
            _close(plan.parts["gathered"], measured["parts"]["gathered"], f"{label} gathered at the peak")
            _close(rest, measured_rest, f"{label} the rest at the peak")


@pytest.mark.timeout(450)
def test_accumulation_policies_peak_as_measured():
    """The peak over a step of 4 micro-batches, each policy's held bytes in it."""
    _check_accum(ACCUM, [r[len(CASES) + len(ADAPTED) :] for r in _ranks()])


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_every_other_accumulation_policy_peaks_as_measured():
    _check_accum(ACCUM_SLOW, run_world(measure_world, 2, ACCUM_SLOW, timeout=400))


def _check_accum(cases: list[dict], ranks: list[list[dict]]) -> None:
    for i, case in enumerate(cases):
        measured = max((r[i] for r in ranks), key=lambda m: m["peak"])
        plan = predict(case)
        _near(plan.peak_bytes, measured["peak"], f"{case} peak")
        assert plan.phase == measured["phase"], case
