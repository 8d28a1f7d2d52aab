"""`fsdp2kit plan` honours or refuses every flag it is given, never ignores one (issue 27: `--lora 8` without
`--batch` printed the full model's ShardPlan and said nothing).

Every argument of the argparse parser is tried in both modes, the ShardPlan alone (no --batch/--seq)
and the memory plan of a step: its output must differ from the run without it, or the command must
fail naming the flag. A flag added to the parser without a row here fails the coverage check.
"""

from __future__ import annotations

import argparse

import pytest

from fsdp2kit.cli import build_parser, main

SHARD = ["demo", "--shard", "2"]
STEP = [*SHARD, "--batch", "2", "--seq", "64"]
CHANGES = "changes"
# flag -> (its values, expected without --batch/--seq, expected with them): CHANGES or a piece of the error.
FLAGS = {
    "model": (["bench-256x4"], CHANGES, CHANGES),
    "--shard": (["4"], CHANGES, CHANGES),
    "--replicate": (["2"], CHANGES, CHANGES),
    "--tp": (["2"], CHANGES, CHANGES),
    "--cp": (["2"], CHANGES, CHANGES),
    "--packed": ([], "--packed: only a training step's", "--packed adds the document mask"),
    "--cp-style": (["ring"], "--cp-style chooses how", "--cp-style chooses how"),
    "--strategy": (["SHARD_GRAD_OP"], CHANGES, CHANGES),
    "--mixed-precision": (["bf16"], CHANGES, CHANGES),
    "--cpu-offload": ([], CHANGES, CHANGES),
    "--lora": (["8"], CHANGES, CHANGES),
    "--qlora": ([], "qlora=True needs a LoRA rank", "qlora=True needs a LoRA rank"),
    "--lora-targets": (["q_proj,v_proj"], "needs a LoRA rank", "needs a LoRA rank"),
    "--replicate-adapters": ([], "--replicate-adapters: only a training step's", "expected a LoRA / QLoRA model"),
    "--batch": (["4"], "needs both --batch and --seq", CHANGES),
    "--seq": (["128"], "needs both --batch and --seq", CHANGES),
    "--ac": (["full"], "--ac: only a training step's memory plan uses it", CHANGES),
    "--optimizer": (["sgd"], "--optimizer: only a training step's", CHANGES),
    "--optimizer-offload": ([], "--optimizer-offload: only a training step's", CHANGES),
    "--prefetch": (["0"], "--prefetch: only a training step's", CHANGES),
    "--device": (["cpu"], "--device: only a training step's", CHANGES),
    "--gpu-memory": (["1GiB"], "--gpu-memory: only a training step's", CHANGES),
    "--json": ([], "--json: only a training step's", CHANGES),
    "--grad-accum": (["4"], "--grad-accum: only a training step's", CHANGES),
    "--accumulation": (["keep_gathered"], "--accumulation: only a training step's", "give --grad-accum M"),
}
# Flags that only mean something beside another one: honoured there, refused where they cannot be.
COMBINATIONS = [
    ({"--lora": ["8"]}, "--lora-targets", ["q_proj,v_proj"], CHANGES),
    ({"--lora": ["8"], "model": ["bench-256x4"]}, "--qlora", [], CHANGES),  # demo's weights split into no NF4 groups
    ({"--lora": ["8"]}, "--tp", ["2"], "lora=8 with tp=2"),
    ({"--lora": ["8"], "--batch": ["2"], "--seq": ["64"]}, "--replicate-adapters", [], CHANGES),
    ({"--lora": ["8"]}, "--lora-targets", ["qkv"], "LoRA targets ['qkv'] match no nn.Linear"),
    ({}, "--cp", ["8"], "cp=8 ranks splits the attention heads: 4 heads and 4 KV heads must both divide by 8"),
    ({"--cpu-offload": [], "--batch": ["2"], "--seq": ["64"]}, "--optimizer-offload", [], "cpu_offload already keeps"),
    ({"--cp": ["2"], "--batch": ["2"], "--seq": ["64"]}, "--packed", [], CHANGES),
    # the ring splits no heads: cp 8 of 4 heads plans
    ({"--cp": ["8"], "--batch": ["1"], "--seq": ["512"]}, "--cp-style", ["ring"], CHANGES),
    ({"--cp": ["2"], "--batch": ["2"], "--seq": ["128"]}, "--cp-style", ["ring"], CHANGES),
    ({"--cp": ["2"], "--batch": ["2"], "--seq": ["64"]}, "--cp-style", ["ring"], "divide by 64 x cp = 128 tokens"),
    ({"--cp": ["2"], "--batch": ["2"], "--seq": ["128"], "--packed": []}, "--cp-style", ["ring"], "got packed rows"),
    ({"--cp": ["2"], "--batch": ["2"], "--seq": ["128"], "--device": ["cpu"]}, "--cp-style", ["ring"], "CUDA only"),
    ({"--grad-accum": ["4"], "--batch": ["2"], "--seq": ["64"]}, "--accumulation", ["keep_gathered"], CHANGES),
    ({"--grad-accum": ["4"], "--batch": ["2"], "--seq": ["64"]}, "--accumulation", ["defer_all_reduce"], "HSDP mesh"),
]

# Step time (--gpu): its flags need a step's plan, and the three beside --gpu need it.
FLAGS.update(
    {
        "--gpu": (["h100"], "--gpu: only a training step's", CHANGES),
        "--nodes": (["1"], "--nodes: only a training step's", "--nodes predicts step time: give --gpu too"),
        "--price-per-gpu-hour": (["1"], "--price-per-gpu-hour: only", "--price-per-gpu-hour predicts step time"),
        "--gpu-set": (["efficiency=0.5"], "--gpu-set: only a training step's", "--gpu-set overrides a --gpu preset"),
    }
)
_STEP = {"--gpu": ["h100"], "--batch": ["2"], "--seq": ["64"]}
COMBINATIONS += [
    (_STEP, "--nodes", ["2"], CHANGES),
    (_STEP, "--price-per-gpu-hour", ["1"], CHANGES),
    (_STEP, "--gpu-set", ["efficiency=0.5"], CHANGES),
]


def _plan_arguments() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = set()
    for action in sub.choices["plan"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names.add(next((o for o in action.option_strings if o.startswith("--")), action.dest))
    return names


def _with(base: list[str], flag: str, values: list[str]) -> list[str]:
    """``base`` with ``flag`` set to ``values`` (replacing its value when ``base`` has it)."""
    if flag == "model":
        return [*values, *base[1:]]
    if flag in base:
        i = base.index(flag)
        return [*base[: i + 1], *values, *base[i + 1 + len(values) :]]
    return [*base, flag, *values]


def _run(capsys, args: list[str]) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _check(capsys, base: list[str], args: list[str], expected: str, label: str) -> None:
    code, out, err = _run(capsys, args)
    if expected == CHANGES:
        _, before, _ = _run(capsys, base)
        assert code == 0, f"{label}: {err}"
        assert out != before, f"{label}: the output is the same as without it (ignored)"
    else:
        assert code == 1 and out == "", f"{label}: expected a refusal, got code {code}: {out[-400:]}"
        assert expected in err and err.count("\n") == 1, f"{label}: {err}"


def test_every_flag_is_in_the_table():
    assert _plan_arguments() == set(FLAGS), "a new `fsdp2kit plan` flag needs a row in FLAGS"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["shard plan", "memory plan"])
def test_every_flag_changes_the_output_or_is_refused(capsys, mode):
    base = SHARD if mode == "shard plan" else STEP
    for flag, (values, *expected) in FLAGS.items():
        _check(capsys, base, _with(base, flag, values), expected[mode == "memory plan"], f"{mode}: {flag}")
    for extra, flag, values, expected in COMBINATIONS:
        with_extra = base
        for f, v in extra.items():
            with_extra = _with(with_extra, f, v)
        _check(capsys, with_extra, _with(with_extra, flag, values), expected, f"{mode}: {extra} + {flag}")
