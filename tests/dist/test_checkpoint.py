"""Checkpointer on real gloo groups: save at 4 ranks (2x2 HSDP), load at 3, 2 and 1; resume;
async; pruning; a rank killed mid-save; every bad input; corrupt steps (integrity).

Four spawns in all (4, 3, 2 and 1 ranks), each running many cases, in that order because each
loads what the ones before saved; the 3- and 2-rank spawns end with a rank killed mid-save.
Each case is asserted on its own.
"""

from __future__ import annotations

import json
import math

import ckpt_cases
import pytest
import torch
from models import build

from fsdp2kit.checkpoint import Checkpointer, PerRank, incomplete_dirs, list_steps
from fsdp2kit.testing import WorldError, run_world

pytestmark = pytest.mark.timeout(240)

_cache: dict[str, object] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


def _once(name: str, fn):
    if name not in _cache:
        _cache[name] = fn()
    return _cache[name]


def _world(fn, world: int, *args, timeout: float) -> list[dict]:
    return [ckpt_cases.unpack(r) for r in run_world(fn, world, *args, timeout=timeout)]


@pytest.fixture(scope="module")
def w4(root):
    def go():
        # One process, no peers: the checkpoint world4 loads at 4 ranks, per-rank values and all.
        Checkpointer(root / "one").save(1, build("tinygpt"), extra={"data": PerRank({"pos": 7}), "shared": 1})
        return _world(ckpt_cases.world4, 4, str(root), timeout=150)

    return _once("w4", go)


def _then_killed(fn, world: int, root, timeout: float):
    """Results of a spawn that ends with a rank killed mid-save (see ckpt_cases.then_killed),
    and the WorldError it ended with."""
    with pytest.raises(WorldError) as info:
        run_world(fn, world, str(root), timeout=timeout)
    try:
        return ckpt_cases.results_of(fn, root, world), str(info.value)
    except FileNotFoundError:  # the cases failed before the kill: show why
        pytest.fail(f"{fn.__name__} failed before its kill case:\n{info.value}")


@pytest.fixture(scope="module")
def w3_and_kill(root, w4):
    return _once("w3", lambda: _then_killed(ckpt_cases.world3_then_kill, 3, root, timeout=150))


@pytest.fixture(scope="module")
def w3(w3_and_kill):
    return w3_and_kill[0]


@pytest.fixture(scope="module")
def w2_and_kill(root, w3):
    return _once("w2", lambda: _then_killed(ckpt_cases.world2_then_kill, 2, root, timeout=180))


@pytest.fixture(scope="module")
def w2(w2_and_kill):
    return w2_and_kill[0]


@pytest.fixture(scope="module")
def killed(root, w3_and_kill, w2_and_kill):
    return {
        "kill_publisher": (root / "kill_publisher", w3_and_kill[1]),
        "kill_writer": (root / "kill_writer", w2_and_kill[1]),
    }


@pytest.fixture(scope="module")
def w1(root, killed):
    paths = [str(killed[n][0]) for n in ("kill_writer", "kill_publisher")]
    return _once("w1", lambda: _world(ckpt_cases.world1, 1, str(root), paths, timeout=120))


def assert_same(got: dict, want: dict, what: str) -> None:
    """Bitwise equality of two snapshots, naming the entries that differ."""
    for part in ("model", "optim"):
        assert set(got.get(part, {})) == set(want.get(part, {})), f"{what}: {part} keys differ"
        bad = []
        for key, w in want.get(part, {}).items():
            g = got[part][key]
            if isinstance(w, torch.Tensor):
                if not (
                    isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
                ):
                    bad.append(key)
            elif g != w:
                bad.append(f"{key}: {g!r} != {w!r}")
        assert not bad, f"{what}: {part} entries differ: {bad[:5]}"
    assert want.get("optim"), f"{what}: the snapshot has no optimizer state to compare"


def _same_on_every_rank(ranks: list[dict], key: str) -> str:
    messages = [r[key] for r in ranks]
    assert all(m == messages[0] for m in messages), f"{key}: ranks raised different messages: {messages}"
    return messages[0]


# ---- resharding --------------------------------------------------------------------------------


def test_hsdp_roundtrip_at_four(w4):
    r0 = w4[0]
    assert r0["steps"] == [7, 8]
    assert r0["waited"] == 8
    assert r0["named"] == 7
    assert r0["note"] == "hsdp 2x2"
    assert_same(r0["named_snap"], r0["snap7"], "4 ranks 2x2 -> 4 ranks 2x2, named step 7")


def test_per_rank_values_at_more_ranks_than_saved(w4):
    for rank, res in enumerate(w4):
        got = res["per_rank"]
        assert got["step"] == 1 and got["shared"] == 1
        if rank == 0:
            assert got["data"] == {"pos": 7} and got["warnings"] == []
        else:  # not in the checkpoint: kept, and said so
            assert got["data"] == {"pos": -1}
            assert len(got["warnings"]) == 2
            text = "\n".join(got["warnings"])
            assert f"rank {rank} has no saved value for per-rank extra ['data']" in text
            assert f"rank {rank}: the checkpoint holds no RNG state for this rank" in text


def test_async_save_took_state_at_save_time(w4, w3):
    # snap8 was taken right after save(8) returned; training changed the model before wait().
    assert_same(w3[0]["snap8"], w4[0]["snap8"], "async step 8 loaded at 3 ranks")


@pytest.mark.parametrize("step", [7, 8])
def test_load_at_three_uneven_1d(w4, w3, step):
    assert w3[0]["newest"] == 8 and w3[0]["named"] == 7
    for rank in w3:
        assert_same(rank[f"snap{step}"], w4[0][f"snap{step}"], f"2x2 at 4 -> 1-D at 3, step {step}")


def test_load_at_two(w4, w2):
    assert w2[0]["from4"] == 8
    assert_same(w2[0]["snap8"], w4[0]["snap8"], "2x2 at 4 -> 1-D at 2")


def test_load_1d_into_2d(w3, w2):
    assert w2[0]["from3"] == 9
    assert_same(w2[0]["snap9"], w3[0]["saved9"], "1-D at 3 -> 2x1 HSDP at 2")


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_load_at_one(w4, w1, kind):
    assert w1[0][f"{kind}_step"] == 8
    assert_same(w1[0][f"{kind}_snap8"], w4[0]["snap8"], f"2x2 at 4 -> {kind} model in a world of one")


def test_load_at_one_from_three(w3, w1):
    assert w1[0]["from3"] == 9
    assert_same(w1[0]["snap9"], w3[0]["saved9"], "1-D at 3 -> world of one")


def test_hf_config_rides_along(w1):
    r = w1[0]
    config = json.loads(r["llama_config"])
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 3
    assert r["llama_step"] == 1
    assert_same(r["llama_loaded"], r["llama_snap"], "tiny llama at 1")


# ---- resume, async, pruning ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_continues_bitwise(w2, mode):
    for rank, res in enumerate(w2):
        uninterrupted, resumed, info = res[f"resume_{mode}"]
        assert info["step"] == 3
        assert info["data"] == {"consumed": 6, "rank": rank}
        assert resumed == uninterrupted, f"rank {rank}: resumed losses {resumed} != uninterrupted {uninterrupted}"


def test_keep_last(w2):
    r = w2[0]
    assert r["prune"] == [[10], [10, 20], [20, 30], [30, 40], [5, 30, 40], [30, 40]]
    assert r["keep_all"] == [1, 2, 3]


def test_overlapping_async_saves(w2):
    r = w2[0]
    assert r["overlap_wait"] == 3 and r["overlap_wait_again"] is None
    assert r["overlap_steps"] == [1, 2, 3]
    assert r["overlap_equal"] == {1: True, 2: True, 3: True}


def test_bad_extra_in_async_save_raises_on_every_rank(w2):
    msg = _same_on_every_rank(w2, "err_async_extra")
    assert "asynchronous save of step 2" in msg and "rank 1 could not prepare the state" in msg, msg
    assert "extra['fn']" in msg, msg
    assert w2[0]["bad_async_steps"] == [1, 3]


def test_failed_async_save_raises(w2):
    msg = _same_on_every_rank(w2, "err_async_wait")
    assert "asynchronous save of step 2" in msg and "No space left on device (injected)" in msg
    msg = _same_on_every_rank(w2, "err_async_next_save")
    assert "asynchronous save of step 3" in msg and "(injected again)" in msg
    r = w2[0]
    assert r["fail_steps"] == [1, 4]  # 2 and 3 failed; 4 went through
    assert r["fail_leftovers"] == []
    msg = _same_on_every_rank(w2, "err_sync_save")
    assert "save of step 5" in msg and "Input/output error (injected)" in msg
    assert r["fail_steps_after_sync"] == [1, 4]
    msg = _same_on_every_rank(w2, "err_read")  # failed on rank 1 only, raised on both
    assert "rank 1" in msg and "reading failed" in msg and "(injected read)" in msg


# ---- bad inputs ------------------------------------------------------------------------------------

ERRORS_2 = {
    "err_extra_value": ["did not start", "rank 1", "extra['fn'] is a function"],
    "err_extra_dtensor": ["extra['w'] is a DTensor"],
    "err_missing_step": ["step 2", "does not exist", "complete steps", "[1]"],
    "err_incomplete_step": ["step 3", "is incomplete"],
    "err_no_optimizer_saved": ["saved without optimizer state"],
    "err_extra_key": ["extra key(s) ['scheduler'] not in the checkpoint", "sched"],
    "err_dtype": ["dtype mismatch", "model.tok.weight: checkpoint torch.float32, here torch.float64"],
    "err_fp32_into_bf16": ["dtype mismatch", "checkpoint torch.float32, here torch.bfloat16"],
    "err_missing_key": ["1 key(s) missing from the checkpoint: model.scale"],
    "err_garbage_metadata": [".metadata is corrupt or not DCP metadata"],
    "err_evil_metadata": ["refusing to load posix.system"],
    "err_truncated": ["__1_0.distcp is truncated"],
    "err_missing_file": ["__0_0.distcp is missing"],
}


@pytest.mark.parametrize("case", sorted(ERRORS_2))
def test_bad_input_world2(w2, case):
    msg = _same_on_every_rank(w2, case)
    for fragment in ERRORS_2[case]:
        assert fragment in msg, f"{case}: {fragment!r} not in:\n{msg}"


def test_bf16_masters_step_resumes_into_fp32_masters(w2):
    for r in w2:
        assert r["bf16_resume_step"] == 1 and r["bf16_resume_exact"]
        assert r["bf16_resume_upcast_count"] > 0 and all(map(math.isfinite, r["bf16_resume_losses"]))
    warned = w2[0]["bf16_resume_warnings"]
    assert len(warned) == 1 and "torch.bfloat16 -> torch.float32" in warned[0], warned
    assert w2[1]["bf16_resume_warnings"] == []  # one note per load, from rank 0


def test_one_agreement_for_the_weight_loaders(w2):
    assert w2[1]["agree_phase"] == "ValueError: bad shard on rank 1"
    assert w2[0]["agree_phase"] == "RuntimeError: a local phase failed:\n  [rank 1] ValueError: bad shard on rank 1"


def test_ranks_disagree_on_step(w2):
    for rank, res in enumerate(w2):
        assert f"save of step {5 + rank}" in res["err_disagree"]
        assert "ranks disagree on the step to save: [5, 6]" in res["err_disagree"]


def test_nothing_published_by_failed_saves(w2):
    r = w2[0]
    assert r["bad_save_listing"] == []
    assert r["none_when_empty"] is None
    assert r["newest_ignores_incomplete"] == 1
    assert r["evil_ran"] is False


ERRORS_3 = {
    "err_other_model": ["in the checkpoint that this model/optimizer lacks", "model.trunk.2.", "another model"],
    "err_shape": ["shape mismatch", "model.tok.weight: checkpoint (96, 40), here (100, 40)", "model.head.weight"],
    "err_optimizer": ["missing from the checkpoint: optimizer.state.", "momentum_buffer", "exp_avg"],
}


@pytest.mark.parametrize("case", sorted(ERRORS_3))
def test_bad_input_world3(w3, case):
    msg = _same_on_every_rank(w3, case)
    for fragment in ERRORS_3[case]:
        assert fragment in msg, f"{case}: {fragment!r} not in:\n{msg}"


# ---- integrity ---------------------------------------------------------------------------------------

CORRUPT = {
    # a flipped byte inside a tensor record of rank 1's file: found by the rank that checks that file
    "flipped": ["cannot load", "[rank 1] data file", "__1_0.distcp is corrupt", "fails its CRC-32 check"],
    # a torn write: the file keeps its length, its tail is zeros
    "zero_tail": ["[rank 0] data file", "__0_0.distcp is corrupt"],
    # a file that lost its last 100 bytes
    "cut": ["[every rank] data file", "__1_0.distcp is truncated"],
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_step_raises_on_every_rank_before_loading(w2, case):
    msg = _same_on_every_rank(w2, f"err_{case}")
    for fragment in CORRUPT[case]:
        assert fragment in msg, f"{case}: {fragment!r} not in:\n{msg}"
    for rank, res in enumerate(w2):
        assert res[f"unchanged_{case}"], f"rank {rank}: the model or optimizer changed before the error ({case})"


def test_verify_false_loads_a_corrupt_step_unchecked(w2):
    for res in w2:
        assert res["unverified_step"] == 1
        assert res["unverified_equal"] is False  # the flipped byte is in a value: loaded, silently wrong


def test_new_step_is_stock_dcp(w2):
    for res in w2:
        assert res["info_checksums"] == "zip-crc32"
        assert res["stock_equal"], "dcp.load with DCP's own FileSystemReader read other values"


def test_format1_fixture_loads_unchecked_at_two(w2):
    for res in w2:
        assert res["format1_step"] == 3 and res["format1_equal"]


# ---- a rank killed during a save -----------------------------------------------------------------


def test_killed_writer(killed, w1):
    path, message = killed["kill_writer"]
    # rank 1 died; rank 0 raised instead of hanging, and said why
    assert "rank 1" in message and "without reporting" in message
    assert "--- rank 0 ---" in message and "CheckpointError" in message and "save of step 2" in message
    assert list_steps(path) == [1]
    assert incomplete_dirs(path) == []  # rank 0 survived and removed its temporary directory
    assert w1[0]["killed0_step"] == 1 and w1[0]["killed0_equal"]


def test_killed_publisher(killed, w1):
    path, message = killed["kill_publisher"]
    assert "rank 0" in message and "without reporting" in message
    sections = message.split("--- rank ")
    assert len(sections) == 4  # a header, then ranks 0, 1 and 2
    for section in sections[2:]:  # the survivors raised, and said why, instead of hanging
        assert "CheckpointError" in section and "lost contact with the other ranks" in section
    leftovers = incomplete_dirs(path)
    # every rank had written step 2, DCP metadata included; unpublished, it must still be ignored
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-step_00000002-")
    assert (leftovers[0] / ".metadata").is_file()
    assert list_steps(path) == [1]
    assert w1[0]["killed1_step"] == 1 and w1[0]["killed1_equal"] and w1[0]["killed1_steps"] == [1]
