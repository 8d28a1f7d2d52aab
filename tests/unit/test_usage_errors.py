"""The recipes' one error path (recipes/support/errors.py), in one process: who prints, what, and the exit status.
Launched under torchrun as a user does: tests/e2e/test_recipe_errors.py."""

from __future__ import annotations

import pytest

from support.data import DataError
from support.errors import ConfigError, run_recipe


def fails(error: Exception):
    def main(argv: list[str]) -> None:
        raise error

    return main


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "FSDP2KIT_DEBUG"):
        monkeypatch.delenv(name, raising=False)


def test_rank_0_prints_the_block_and_exits_1(capsys):
    with pytest.raises(SystemExit) as exit:
        run_recipe(fails(DataError("data file x.jsonl does not exist")), [])
    assert exit.value.code == 1
    assert capsys.readouterr() == ("", "data error: data file x.jsonl does not exist\n")


def test_other_ranks_print_nothing(capsys, monkeypatch):
    # Outside torchrun there is no store to meet in: every rank exits 1, only rank 0 having spoken.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit:
        run_recipe(fails(ConfigError("unknown option --x")), [])
    assert exit.value.code == 1 and capsys.readouterr() == ("", "")


@pytest.mark.parametrize("switch", ["argv", "env"])
def test_debug_raises_the_exception_itself(monkeypatch, switch):
    if switch == "env":
        monkeypatch.setenv("FSDP2KIT_DEBUG", "1")
    with pytest.raises(ConfigError, match="unknown option --x"):
        run_recipe(fails(ConfigError("unknown option --x")), ["--debug"] if switch == "argv" else [])


def test_other_exceptions_are_not_a_users_mistake():
    with pytest.raises(RuntimeError, match="a bug"):
        run_recipe(fails(RuntimeError("a bug")), [])


def test_a_diagnosis_is_one_training_block(capsys):
    """fsdp2kit.diagnostics' errors end a run like a mistake: the diagnosis, in the recipe's terms, and the way on."""
    from fsdp2kit.diagnostics import DesyncError, NonFiniteError

    nan = NonFiniteError(
        "step 3: non-finite loss on rank 1. Or skip such steps (on_nonfinite='skip').", step=3, module=""
    )
    with pytest.raises(SystemExit) as exit:
        run_recipe(fails(nan), [])
    assert exit.value.code == 1 and capsys.readouterr() == (
        "",
        "training error: step 3: non-finite loss on rank 1. Or skip such steps (--train.on_nonfinite skip); "
        "relaunch the same command to resume from the newest checkpoint.\n",
    )
    desync = DesyncError("rank 0: ranks disagree at a check at step 3.\nDiverged: rank 1.", diverged=[1], positions={})
    with pytest.raises(SystemExit) as exit:
        run_recipe(fails(desync), [])
    assert exit.value.code == 1 and capsys.readouterr().err == (
        "training error: rank 0: ranks disagree at a check at step 3.\nDiverged: rank 1.\n"
        "Relaunch the same command to resume from the newest checkpoint.\n"
    )
    with pytest.raises(DesyncError):  # --debug: the exception itself, traceback and all
        run_recipe(fails(desync), ["--debug"])
