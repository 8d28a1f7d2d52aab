"""Checkpointer cases, run inside `run_world` ranks; tests/dist/test_checkpoint.py asserts on them.

Each world-size function runs many cases in one spawn and returns plain data: snapshots of the
full (gathered) model and optimizer state to compare across world sizes in the parent, and for
each error case the message every rank raised.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import random
import shutil
import signal
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import TinyGPT, build, lm_loss
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp2kit as fk
import fsdp2kit.checkpoint.checkpointer as checkpointer_module
from fsdp2kit._internal.agree import all_ranks_or_none
from fsdp2kit.checkpoint import Checkpointer, CheckpointError, PerRank, RNGState, list_steps, read_metadata, step_dir
from fsdp2kit.checkpoint.unpickler import SafeReader

VOCAB, SEQ, BATCH = 96, 12, 2


# ---- helpers --------------------------------------------------------------------------------


def packed(fn):
    """Return ``fn``'s result as torch.save bytes: tensors sent through torch.multiprocessing's
    queue travel as shared-memory handles that die with the rank before the parent reads them."""

    @functools.wraps(fn)
    def wrapper(*args):
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        return buf.getvalue()

    return wrapper


def unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def then_killed(fn, kill):
    """Run ``fn``, save its result to ``root/<fn>_rank<r>.pt``, then run ``kill``, in which a
    rank dies: the kill cases ride on a spawn that exists anyway (each spawn costs seconds)."""

    def wrapper(root: str, *args):
        out = fn(root, *args)
        torch.save(out, Path(root) / f"{wrapper.__name__}_rank{dist.get_rank()}.pt")
        kill(str(Path(root) / kill.__name__))

    # spawn finds the function by name: the name it is bound to below
    wrapper.__name__ = wrapper.__qualname__ = f"{fn.__name__}_then_kill"
    return wrapper


def results_of(fn, root, world: int) -> list:
    return [torch.load(Path(root) / f"{fn.__name__}_rank{r}.pt", weights_only=True) for r in range(world)]


def sharded(model: torch.nn.Module | None = None, *, shard: int = -1, replicate: int = 1, seed: int = 0):
    model = model if model is not None else build("tinygpt", seed=seed)
    fk.shard_model(model, fk.make_mesh(shard=shard, replicate=replicate))
    return model


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)


def train(model, opt, steps: int, sched=None, gen_seed: int | None = None) -> list[float]:
    """Steps whose data come from the global torch, Python and NumPy generators (unless a seed
    is given), so that only a restored RNG state can reproduce them."""
    gen = torch.Generator().manual_seed(gen_seed) if gen_seed is not None else None
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        tokens = (tokens + random.randrange(VOCAB)) % VOCAB
        tokens[:, int(np.random.randint(SEQ))] = 0
        loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model, opt=None) -> dict:
    """Full tensors of every model and optimizer entry (collective), cloned to CPU."""

    def full(v):
        if isinstance(v, DTensor):
            v = v.full_tensor()
        return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v

    snap = {"model": {k: full(v) for k, v in get_model_state_dict(model).items()}}
    if opt is not None:
        osd = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
        )
        snap["optim"] = {k: full(v) for k, v in osd.items()}
    return snap


def error_of(fn, *args, **kwargs) -> str:
    """The CheckpointError message ``fn`` raises (on this rank), or a note that it did not."""
    try:
        fn(*args, **kwargs)
    except CheckpointError as e:
        return str(e)
    except Exception as e:
        return f"WRONG TYPE {type(e).__name__}: {e}"
    return "NO ERROR"


def rank0_then_barrier(fn, *args) -> None:
    if dist.get_rank() == 0:
        fn(*args)
    dist.barrier()


def copy_root(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


class _Inject:
    """Make DCP's file writer fail on one rank (in whichever thread writes)."""

    def __init__(self, rank: int, message: str):
        self.rank, self.message, self.orig = rank, message, _FileSystemWriter.write_data

    def __enter__(self):
        if dist.get_rank() == self.rank:
            message = self.message

            def failing(*args, **kwargs):
                raise OSError(message)

            _FileSystemWriter.write_data = failing
        return self

    def __exit__(self, *exc):
        _FileSystemWriter.write_data = self.orig


# ---- world 4: save on a 2x2 HSDP mesh -----------------------------------------------------------


@packed
def world4(root: str) -> dict:
    root = Path(root)
    model = sharded(shard=2, replicate=2)
    opt = adamw(model)
    train(model, opt, 2, gen_seed=1)
    ck = Checkpointer(root / "w4", keep_last=2)
    ck.save(7, model, optimizer=opt, extra={"note": "hsdp 2x2"})
    snap7 = snapshot(model, opt)

    train(model, opt, 1, gen_seed=2)
    ack = Checkpointer(root / "w4", keep_last=2, async_save=True)
    ack.save(8, model, optimizer=opt)
    snap8 = snapshot(model, opt)
    train(model, opt, 1, gen_seed=3)  # changes the live state while the save is in flight
    waited = ack.wait()
    ack.close()

    # Named step, loaded back at the same shape into a differently initialised model.
    fresh = sharded(shard=2, replicate=2, seed=5)
    fresh_opt = adamw(fresh)
    loaded = ck.load(fresh, optimizer=fresh_opt, step=7)
    # A checkpoint saved by one process: ranks 1-3 have no per-rank values or RNG state in it.
    extra = {"data": PerRank({"pos": -1}), "shared": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_one = Checkpointer(root / "one").load(build("tinygpt", seed=5), extra=extra)
    per_rank = {
        "step": from_one,
        "data": extra["data"].value,
        "shared": extra["shared"],
        "warnings": sorted(str(w.message) for w in caught if "saved by fewer ranks" in str(w.message)),
    }

    out = {
        "per_rank": per_rank,
        "steps": list_steps(root / "w4"),
        "waited": waited,
        "named": loaded,
        "named_snap": snapshot(fresh, fresh_opt),
        "note": ck.loaded_extra.get("note"),
    }
    if dist.get_rank() == 0:
        out.update(snap7=snap7, snap8=snap8)
    return out


# ---- world 3: load 2-D -> 1-D with uneven shards, save 1-D --------------------------------------


def world3(root: str) -> dict:
    root = Path(root)
    out: dict = {}
    ck = Checkpointer(root / "w4")
    model = sharded()  # 1-D mesh of 3: 40, 96, 160 rows do not split evenly
    opt = adamw(model)
    out["newest"] = ck.load(model, optimizer=opt)
    out["snap8"] = snapshot(model, opt)
    out["named"] = ck.load(model, optimizer=opt, step=7)
    out["snap7"] = snapshot(model, opt)

    train(model, opt, 1, gen_seed=4)
    Checkpointer(root / "w3").save(9, model, optimizer=opt)
    out["saved9"] = snapshot(model, opt)

    # Another model of the same family: one block fewer, a wider vocabulary, another optimizer.
    out["err_other_model"] = error_of(ck.load, TinyGPT(depth=2))
    out["err_shape"] = error_of(ck.load, sharded(TinyGPT(vocab=100)))
    sgd_model = sharded()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    out["err_optimizer"] = error_of(ck.load, sgd_model, optimizer=sgd)
    return out


# ---- world 2: 2-D/1-D loads, resume, async, pruning and every bad input -------------------------


def _resume(root: Path, async_save: bool) -> tuple[list[float], list[float], dict]:
    rank = dist.get_rank()

    def run(seed: int):
        model = sharded(seed=seed)
        opt = adamw(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        torch.manual_seed(100 + rank + seed)
        random.seed(200 + rank + seed)
        np.random.seed(300 + rank + seed)
        return model, opt, sched

    # Synchronous: the Checkpointer's own per-rank RNG states (rng=True). Asynchronous: rng=False
    # and an RNGState in extra instead, as recipes/train.py does; it must be stored per rank too.
    rng = {} if not async_save else {"rng": RNGState()}
    model, opt, sched = run(0)
    ck = Checkpointer(root, async_save=async_save, rng=not async_save)
    first = train(model, opt, 3, sched)
    ck.save(
        3,
        model,
        optimizer=opt,
        extra={"scheduler": sched, "data": PerRank({"consumed": 3 * BATCH, "rank": rank}), **rng},
    )
    uninterrupted = first + train(model, opt, 3, sched)  # in flight, if asynchronous
    ck.wait()

    model, opt, sched = run(1)  # other weights and other generator states: all must be overwritten
    extra = {"scheduler": sched, "data": PerRank(None), **rng}
    step = Checkpointer(root, rng=not async_save).load(model, optimizer=opt, extra=extra)
    resumed = train(model, opt, 3, sched)
    return uninterrupted[3:], resumed, {"step": step, "data": extra["data"].value, "lr": opt.param_groups[0]["lr"]}


def world2(root: str) -> dict:
    root = Path(root)
    rank = dist.get_rank()
    out: dict = {}

    # 2-D -> 1-D across world sizes, and 1-D (3 ranks) -> 2-D (a 2x1 HSDP mesh).
    model = sharded()
    opt = adamw(model)
    out["from4"] = Checkpointer(root / "w4").load(model, optimizer=opt)
    out["snap8"] = snapshot(model, opt)
    hsdp = sharded(shard=1, replicate=2)
    hsdp_opt = adamw(hsdp)
    out["from3"] = Checkpointer(root / "w3").load(hsdp, optimizer=hsdp_opt)
    out["snap9"] = snapshot(hsdp, hsdp_opt)

    # Resume continues the losses bit for bit, saving synchronously and asynchronously.
    for mode in ("sync", "async"):
        out[f"resume_{mode}"] = _resume(root / f"resume_{mode}", async_save=mode == "async")

    # keep_last: only the newest steps stay, and the step just saved is kept even if older.
    ck = Checkpointer(root / "prune", keep_last=2)
    seen = []
    for step in (10, 20, 30, 40):
        ck.save(step, model)
        seen.append(list_steps(root / "prune"))
    ck.save(5, model)
    seen.append(list_steps(root / "prune"))
    ck.save(40, model)  # the same step again: replaced
    seen.append(list_steps(root / "prune"))
    keep_all = Checkpointer(root / "keep_all", keep_last=None)
    for step in (1, 2, 3):
        keep_all.save(step, model)
    out["prune"] = seen
    out["keep_all"] = list_steps(root / "keep_all")

    # Overlapping asynchronous saves: each waits for the one before; all three land intact.
    ack = Checkpointer(root / "overlap", keep_last=None, async_save=True)
    snaps = {}
    for step in (1, 2, 3):
        ack.save(step, model, optimizer=opt, extra={"step": step})
        snaps[step] = snapshot(model, opt)
        train(model, opt, 1, gen_seed=step)
    out["overlap_wait"] = ack.wait()
    out["overlap_wait_again"] = ack.wait()
    out["overlap_steps"] = list_steps(root / "overlap")
    check = sharded(seed=9)
    check_opt = adamw(check)
    out["overlap_equal"] = {}
    for step in (1, 2, 3):
        reader = Checkpointer(root / "overlap")
        reader.load(check, optimizer=check_opt, step=step)
        out["overlap_equal"][step] = _same(snapshot(check, check_opt), snaps[step]) and reader.loaded_extra == {
            "step": step
        }

    # A failed asynchronous save raises at wait() on every rank; the previous step stays newest.
    fail_root = root / "fail"
    fck = Checkpointer(fail_root, async_save=True)
    fck.save(1, model)
    fck.wait()
    with _Inject(rank=1, message="No space left on device (injected)"):
        fck.save(2, model)
        out["err_async_wait"] = error_of(fck.wait)
    with _Inject(rank=1, message="No space left on device (injected again)"):
        fck.save(3, model)
        out["err_async_next_save"] = error_of(fck.save, 4, model)  # the failure of 3 surfaces here
    fck.save(4, model)
    fck.wait()
    out["fail_steps"] = list_steps(fail_root)
    out["fail_leftovers"] = sorted(p.name for p in fail_root.iterdir() if not p.name.startswith("step_"))
    sck = Checkpointer(fail_root)
    with _Inject(rank=0, message="Input/output error (injected)"):
        out["err_sync_save"] = error_of(sck.save, 5, model)
    out["fail_steps_after_sync"] = list_steps(fail_root)

    # A bad extra value on one rank of an asynchronous Checkpointer (past its first save, its
    # staging buffers made): raised on every rank by the next wait, nothing published.
    bad_async = Checkpointer(root / "bad_async", async_save=True)
    bad_async.save(1, model, optimizer=opt)
    bad_async.save(2, model, optimizer=opt, extra={"fn": (lambda: 0) if rank == 1 else 0})
    out["err_async_extra"] = error_of(bad_async.wait)
    bad_async.save(3, model, optimizer=opt)
    bad_async.close()
    out["bad_async_steps"] = list_steps(root / "bad_async")

    # Bad inputs at save time: reported by every rank, and nothing is published.
    bad = root / "bad_save"
    out["err_extra_value"] = error_of(Checkpointer(bad).save, 1, model, extra={"fn": (lambda: 0) if rank == 1 else 0})
    out["err_extra_dtensor"] = error_of(Checkpointer(bad).save, 1, model, extra={"w": next(model.parameters())})
    out["err_disagree"] = error_of(Checkpointer(bad).save, 5 + rank, model)
    out["bad_save_listing"] = sorted(p.name for p in bad.iterdir()) if bad.exists() else []

    # Bad inputs at load time.
    good = root / "good"
    Checkpointer(good).save(1, model, extra={"sched": {"last": 1}})
    ck = Checkpointer(good)
    out["none_when_empty"] = Checkpointer(root / "nothing_here").load(model)
    out["err_missing_step"] = error_of(ck.load, model, step=2)

    # A read that fails on one rank only (ranks read without DCP's collectives): every rank raises.
    def failing_read(*args, **kwargs):
        raise OSError("Input/output error (injected read)")

    if rank == 1:
        SafeReader.read_data = failing_read
    try:
        out["err_read"] = error_of(ck.load, model)
    finally:
        if rank == 1:
            del SafeReader.read_data  # FileSystemReader's own again
    rank0_then_barrier(lambda: (good / "step_00000003").mkdir())
    out["err_incomplete_step"] = error_of(ck.load, model, step=3)
    out["newest_ignores_incomplete"] = ck.load(model)
    out["err_no_optimizer_saved"] = error_of(ck.load, model, optimizer=adamw(model))
    out["err_extra_key"] = error_of(ck.load, model, extra={"scheduler": None})
    # Metadata checks need no sharding: plain models are cheaper to build.
    out["err_dtype"] = error_of(ck.load, build("tinygpt").double())
    out.update(_bf16_masters_resume(root / "bf16_masters"))

    class WithScale(TinyGPT):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))

    out["err_missing_key"] = error_of(ck.load, WithScale())

    def corrupt(name: str, how) -> str:
        dst = root / f"corrupt_{name}"
        rank0_then_barrier(lambda: (copy_root(good, dst), how(step_dir(dst, 1))))
        return error_of(Checkpointer(dst).load, model)

    out["err_garbage_metadata"] = corrupt("garbage", lambda d: (d / ".metadata").write_bytes(b"not a pickle at all"))
    marker = root / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    out["err_evil_metadata"] = corrupt("evil", lambda d: (d / ".metadata").write_bytes(pickle.dumps(Evil())))
    out["evil_ran"] = marker.exists()

    def truncate(d: Path) -> None:
        f = d / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    out["err_truncated"] = corrupt("truncated", truncate)
    out["err_missing_file"] = corrupt("missing_file", lambda d: (d / "__0_0.distcp").unlink())
    out.update(_integrity(root / "integrity", model, opt))

    # The same agreement outside the checkpointer (the weight loaders'): a failure on rank 1 of the
    # model's mesh is rank 1's own exception there, and a RuntimeError naming it on rank 0.
    try:
        with all_ranks_or_none(model, "a local phase"):
            if rank == 1:
                raise ValueError("bad shard on rank 1")
        out["agree_phase"] = "NO ERROR"
    except Exception as e:
        out["agree_phase"] = f"{type(e).__name__}: {e}"
    return out


def _bf16_masters_resume(root: Path) -> dict:
    """A step of a run with bf16 master weights and AdamW moments (what fsdp2kit did with a bf16
    checkpoint before fp32 masters were the rule; pure_bf16 now) resumes into fp32 masters: every
    value upcast exactly, one warning (rank 0) naming it. A narrowing load stays an error."""
    old = build("tinygpt", seed=3)
    fk.shard_model(old, fk.make_mesh(), mixed_precision="pure_bf16")
    old_opt = adamw(old)
    train(old, old_opt, 2, gen_seed=3)
    Checkpointer(root).save(1, old, optimizer=old_opt)
    before = snapshot(old, old_opt)
    new = build("tinygpt", seed=4)
    fk.shard_model(new, fk.make_mesh(), mixed_precision="bf16")
    new_opt = adamw(new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = Checkpointer(root).load(new, optimizer=new_opt)
    after = snapshot(new, new_opt)
    exact = all(
        v.dtype == torch.float32 and torch.equal(v, before[part][k].float())
        for part in ("model", "optim")
        for k, v in after[part].items()
        if isinstance(v, torch.Tensor) and before[part][k].dtype == torch.bfloat16
    )
    Checkpointer(root / "fp32").save(1, new, optimizer=new_opt)
    return {
        "bf16_resume_step": step,
        "bf16_resume_exact": exact,
        "bf16_resume_upcast_count": sum(
            isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16
            for p in ("model", "optim")
            for v in before[p].values()
        ),
        "bf16_resume_warnings": [str(w.message) for w in caught if "upcast" in str(w.message)],
        "bf16_resume_losses": train(new, new_opt, 1, gen_seed=5),  # it trains on from there
        "err_fp32_into_bf16": error_of(Checkpointer(root / "fp32").load, old, optimizer=old_opt),
    }


def _largest_record(step: Path, file: str) -> tuple[int, int]:
    """(offset, length) of the largest record in one of the step's data files: mostly tensor bytes."""
    infos = read_metadata(step).storage_data.values()
    return max(((i.offset, i.length) for i in infos if i.relative_path == file), key=lambda r: r[1])


def _flip_byte(step: Path) -> None:
    """One byte in the middle of rank 1's largest record: inside the tensor's bytes, which the
    zip structure around them does not cover (the verify=False case checks that it lands there)."""
    offset, length = _largest_record(step, "__1_0.distcp")
    with open(step / "__1_0.distcp", "r+b") as fh:
        fh.seek(offset + length // 2)
        byte = fh.read(1)[0]
        fh.seek(offset + length // 2)
        fh.write(bytes([byte ^ 0x40]))


def _zero_tail(step: Path) -> None:
    """A torn write: the file keeps its length, its last 4 KB are zeros (the last record's end)."""
    file = step / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    data[-4096:] = bytes(4096)
    file.write_bytes(bytes(data))


def _live(model, opt) -> list[torch.Tensor]:
    """This rank's own shards of every parameter, buffer and optimizer state, cloned."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return [(t.to_local() if isinstance(t, DTensor) else t).detach().clone() for t in tensors]


def _integrity(root: Path, model, opt) -> dict:
    """Corrupt steps raise on every rank, naming the file, before the model or optimizer changes;
    verify=False skips the check; stock DCP reads a new step; the format-1 fixture still loads."""
    out: dict = {}
    good = root / "good"
    Checkpointer(good).save(1, model, optimizer=opt)
    saved = snapshot(model, opt)
    out["info_checksums"] = json.loads((step_dir(good, 1) / "fsdp2kit.json").read_text()).get("checksums")

    fresh = sharded(seed=7)
    fresh_opt = adamw(fresh)
    train(fresh, fresh_opt, 1, gen_seed=7)  # optimizer state exists, and differs from the saved one
    before = _live(fresh, fresh_opt)
    for name, how in (("flipped", _flip_byte), ("zero_tail", _zero_tail), ("cut", lambda d: _cut(d / "__1_0.distcp"))):
        dst = root / name
        rank0_then_barrier(lambda: (copy_root(good, dst), how(step_dir(dst, 1))))  # noqa: B023
        out[f"err_{name}"] = error_of(Checkpointer(dst).load, fresh, optimizer=fresh_opt)
        out[f"unchanged_{name}"] = all(torch.equal(a, b) for a, b in zip(_live(fresh, fresh_opt), before))

    # verify=False: the flipped step loads, silently wrong where the byte flipped
    out["unverified_step"] = Checkpointer(root / "flipped", verify=False).load(fresh, optimizer=fresh_opt)
    out["unverified_equal"] = _same(snapshot(fresh, fresh_opt), saved)

    # stock DCP (its own FileSystemReader and planner, with its collectives) reads the new step
    plain = sharded(seed=8)
    state = {"model": get_model_state_dict(plain)}
    dcp.load(state, storage_reader=FileSystemReader(step_dir(good, 1)))
    set_model_state_dict(plain, state["model"])
    out["stock_equal"] = _same(snapshot(plain), {"model": saved["model"]})

    # the format-1 fixture (written before checksums were recorded) loads, unchecked, at 2 ranks
    from fixtures.make_ckpt_format1 import tiny_model

    fixture = Path(__file__).resolve().parent / "fixtures" / "ckpt_format1"
    old = sharded(tiny_model())
    old_opt = torch.optim.AdamW(old.parameters(), lr=5.0)
    out["format1_step"] = Checkpointer(fixture, keep_last=None, rng=False).load(old, optimizer=old_opt)
    out["format1_equal"] = _same(snapshot(old, old_opt), torch.load(fixture / "expected.pt", weights_only=True))
    return out


def _cut(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])  # the last record loses its end


def _same(a: dict, b: dict) -> bool:
    for part in ("model", "optim"):
        if set(a.get(part, {})) != set(b.get(part, {})):
            return False
        for k, v in a.get(part, {}).items():
            w = b[part][k]
            if isinstance(v, torch.Tensor):
                if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and torch.equal(v, w)):
                    return False
            elif v != w:
                return False
    return True


# ---- a rank killed during a save ------------------------------------------------------------------


def kill_writer(root: str) -> None:
    """Rank 1 dies with half of its file written; rank 0 must fail (not hang) and publish nothing."""
    model = sharded()
    ck = Checkpointer(root)
    ck.save(1, model)
    if dist.get_rank() == 1:
        orig = _FileSystemWriter.write_data

        def write_half_then_die(self, plan, planner):
            orig(self, plan, planner).wait()
            for f in Path(self.path).glob("__1_*"):
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        _FileSystemWriter.write_data = write_half_then_die
    train(model, adamw(model), 1, gen_seed=0)
    ck.save(2, model)


def kill_publisher(root: str) -> None:
    """Rank 0 dies after every rank has written step 2 (DCP's .metadata included), before the rename."""
    model = sharded()
    ck = Checkpointer(root)
    ck.save(1, model)
    if dist.get_rank() == 0:
        # The publishing rename is the checkpointer module's `publish`: replace it with a crash.
        checkpointer_module.publish = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    train(model, adamw(model), 1, gen_seed=0)
    ck.save(2, model)


# ---- world 1 ------------------------------------------------------------------------------------


@packed
def world1(root: str, killed: list[str]) -> dict:
    root = Path(root)
    out: dict = {}
    for name, make in (("plain", lambda: build("tinygpt", seed=3)), ("sharded", lambda: sharded(seed=3))):
        model = make()
        opt = adamw(model)
        out[f"{name}_step"] = Checkpointer(root / "w4").load(model, optimizer=opt)
        out[f"{name}_snap8"] = snapshot(model, opt)
    model = build("tinygpt", seed=3)
    opt = adamw(model)
    out["from3"] = Checkpointer(root / "w3").load(model, optimizer=opt)
    out["snap9"] = snapshot(model, opt)

    # The checkpoints whose second save a killed rank interrupted: step 1 loads, as saved.
    expected = snapshot(build("tinygpt", seed=0))
    for i, path in enumerate(killed):
        model = build("tinygpt", seed=3)
        out[f"killed{i}_step"] = Checkpointer(path).load(model)
        out[f"killed{i}_equal"] = _same(snapshot(model), expected)
        out[f"killed{i}_steps"] = list_steps(path)

    # A Hugging Face model: config.json rides along, and a fresh model loads identically.
    from models import tiny_llama

    llama = tiny_llama()
    fk.shard_model(llama, fk.make_mesh())
    llama_opt = adamw(llama)
    train(llama, llama_opt, 1, gen_seed=0)
    Checkpointer(root / "llama").save(1, llama, optimizer=llama_opt, extra={"scheduler": {"epoch": 1}})
    out["llama_config"] = (step_dir(root / "llama", 1) / "config.json").read_text()
    out["llama_snap"] = snapshot(llama, llama_opt)
    torch.manual_seed(11)
    again = tiny_llama()
    fk.shard_model(again, fk.make_mesh())
    again_opt = adamw(again)
    out["llama_step"] = Checkpointer(root / "llama").load(again, optimizer=again_opt)
    out["llama_loaded"] = snapshot(again, again_opt)
    return out


# The world-3 spawn ends with rank 0 dying before it publishes; the world-2 one with rank 1 dying
# mid-write. Their results are saved to files first (see then_killed).
world3_then_kill = then_killed(world3, kill_publisher)
world2_then_kill = then_killed(world2, kill_writer)
