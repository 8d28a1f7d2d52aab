"""The recipe with `[parallel] cp`: a short cp-2 run under torchrun; in the slow tier, the same run at cp 1
in one process (the same global batch) for parity, and a resume of the cp-2 checkpoint at cp 1 on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recipes import DEMO, FAST, records, run


def _cp_args(tmp: Path, cp: int, steps: int, shard: int = 1, log: str = "log.jsonl") -> list[str]:
    args = ["--config", DEMO, *FAST, "--train.steps", str(steps), "--parallel.cp", str(cp)]
    return [*args, "--parallel.shard", str(shard), "--checkpoint.dir", str(tmp / "ckpt"), "--log.jsonl", str(tmp / log)]


@pytest.mark.timeout(600)
def test_train_with_cp_2(tmp_path: Path):
    _, out = run(_cp_args(tmp_path, 2, 10), tmp_path)
    rec = records(tmp_path / "log.jsonl")
    assert rec[10]["loss"] < rec[1]["loss"], rec  # bytes: ln(256) = 5.5 at the start
    assert "shard_cp=2" in out, out[-3000:]  # FSDP shards over the cp ranks


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cp_2_matches_one_process_and_resumes_at_cp_1(tmp_path: Path):
    losses = {}
    for cp, nproc in ((2, 2), (1, None)):
        work = tmp_path / f"cp{cp}"
        work.mkdir()
        run(_cp_args(work, cp, 20), work, nproc=nproc)
        rec = records(work / "log.jsonl")
        losses[cp] = [rec[10]["loss"], rec[20]["loss"]]
    # The same global batch (one data-parallel group), the same seed: the loss of one process on the whole sequence.
    assert losses[2] == pytest.approx(losses[1], rel=1e-4), losses
    # the cp-2 checkpoint of step 20 continues at cp 1 over 2 FSDP ranks
    work = tmp_path / "cp2"
    _, out = run(_cp_args(work, 1, 30, shard=2, log="resumed.jsonl"), work)
    assert "resumed from" in out and "step_00000020" in out, out[-3000:]
