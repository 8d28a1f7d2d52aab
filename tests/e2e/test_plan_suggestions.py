"""Every change `fsdp2kit plan` can suggest is a recipe option that runs (issue 24).

The search (`fsdp2kit.planner.search`) prints, for each change that fits, the recipe options that
make it (``recipes/train.py --table.key value``). Here every change it can print from a run that
leaves every knob open (fp32, no AC, AdamW, HSDP 2 x 2, batch 4, no offload, no LoRA) — each
single change and each pair, fitting or not — is started as ``--train.plan_only`` through the
recipe's own entry point, in this process: the recipe must accept the options and plan exactly
the settings the search planned. Optimizer-state offload needs a GPU to train, so a plan is how
it starts here.

Default tier: every change's options go through the recipe's checks and its planning call (the
planner itself stubbed: what it is asked is compared), and every single change is planned for
real, its peak compared with the search's. The slow tier plans every pair for real too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import re
from pathlib import Path

import pytest

import fsdp2kit as fk
from fsdp2kit._internal.fmt import fmt_bytes
from fsdp2kit.models import build_causal_lm
from fsdp2kit.planner.api import Settings, plan_settings
from fsdp2kit.planner.search import all_changes, candidates, recipe_flags

ROOT = Path(__file__).resolve().parents[2]
BASE = Settings(shard=2, replicate=2, batch=4, seq=64, packed=True)  # demo.toml packs its rows
RECIPE = [
    "--config", str(ROOT / "recipes" / "configs" / "demo.toml"), "--train.plan_only", "true",
    "--parallel.shard", "2", "--parallel.replicate", "2", "--data.batch_size", "4", "--data.seq_len", "64",
]  # fmt: skip


def _train():
    spec = importlib.util.spec_from_file_location("recipe_train", ROOT / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PLANS: dict[Settings, tuple[str, object]] = {}


def _plans() -> dict[Settings, tuple[str, object]]:
    """Every distinct change the search tries from BASE: settings -> (its first label, its plan, or the
    ValueError that keeps the search from printing it, as the real run would raise it)."""
    if not _PLANS:
        model, cache = build_causal_lm("demo", meta=True), {}
        for label, _, settings in all_changes(BASE):
            if settings not in _PLANS:
                try:
                    _PLANS[settings] = (label, plan_settings(model, settings, cache))
                except ValueError as e:
                    _PLANS[settings] = (label, e)
    return _PLANS


def _changes() -> dict[Settings, str]:
    """Every distinct change the search can print from BASE: settings -> its first label."""
    return {s: label for s, (label, plan) in _plans().items() if not isinstance(plan, ValueError)}


def _planned_settings(kwargs: dict) -> Settings:
    """The Settings behind the recipe's `fk.plan_memory` call."""
    names = {f.name for f in dataclasses.fields(Settings)}
    return dataclasses.replace(BASE, **{k: v for k, v in kwargs.items() if k in names})


def test_the_candidate_set_covers_every_knob():
    labels = " ".join(label for label, _, _ in candidates(BASE))
    for flag in ("--mixed-precision pure_bf16", "--ac op", "--optimizer adamw8bit", "--optimizer adamw4bit"):
        assert flag in labels
    for flag in ("--optimizer adamw_fp8", "--optimizer-offload", "--cpu-offload", "--batch 2", "--replicate 1"):
        assert flag in labels
    changes = _changes()
    assert any("--optimizer-offload + " in label for label in changes.values())  # pairs too
    # a pair's options are its two changes' options
    pair = next(s for s, label in changes.items() if label == "--optimizer adamw8bit + --mixed-precision pure_bf16")
    assert recipe_flags(BASE, pair) == ["--parallel.mixed_precision", "pure_bf16", "--optim.name", "adamw8bit"]


@pytest.mark.timeout(120)
def test_every_suggestion_starts_the_recipe_with_the_settings_it_planned(monkeypatch):
    train = _train()
    asked: list[dict] = []

    def plan_memory(model, **kwargs):
        asked.append(kwargs)
        return "memory plan stubbed"

    monkeypatch.setattr(fk, "plan_memory", plan_memory)
    changes = _changes()
    for settings, label in changes.items():
        with contextlib.redirect_stdout(io.StringIO()):
            train.main(RECIPE + recipe_flags(BASE, settings))  # raises on an option it refuses
        assert _planned_settings(asked.pop()) == settings, label
    assert len(changes) > 40
    assert any("--accumulation keep_gathered_defer_all_reduce" in label for label in changes.values())
    # what the search cannot plan (QLoRA's NF4 groups do not divide the demo's weights at 2 ranks), the recipe refuses
    refused = [s for s, (_, plan) in _plans().items() if isinstance(plan, ValueError)]
    assert refused
    for settings in refused:
        with pytest.raises(ValueError), contextlib.redirect_stdout(io.StringIO()):
            train.main(RECIPE + recipe_flags(BASE, settings))


def _peak_printed(out: str) -> str:
    line = re.search(r"^peak\s+(\S+ \S+)\s+per rank", out, re.M)
    assert line, out[-3000:]
    return line.group(1)


def _plan_for_real(items: list[tuple[Settings, str]]) -> None:
    train = _train()
    for settings, label in items:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train.main(RECIPE + recipe_flags(BASE, settings))
        assert "memory plan unavailable" not in out.getvalue(), (label, out.getvalue()[-2000:])
        assert _peak_printed(out.getvalue()) == fmt_bytes(_plans()[settings][1].peak_bytes), label


@pytest.mark.timeout(120)
def test_every_single_change_plans_in_the_recipe_as_the_search_planned_it():
    _plan_for_real([(s, label) for s, label in _changes().items() if " + " not in label])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_pair_plans_in_the_recipe_as_the_search_planned_it():
    _plan_for_real([(s, label) for s, label in _changes().items() if " + " in label])
