"""The Checkpointer: atomic, resumable, optionally asynchronous DCP checkpoints, resharded on load."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from fsdp2kit._internal.agree import agree
from fsdp2kit._internal.fmt import fmt_list
from fsdp2kit.checkpoint.checks import CHECKSUMS, check_against, check_extra_keys, check_optimizer, verify_files
from fsdp2kit.checkpoint.comm import FAILURES, active, describe, new_group, quiet_dcp, rank_world
from fsdp2kit.checkpoint.extras import PerRank, RNGState
from fsdp2kit.checkpoint.layout import (
    CheckpointError,
    check_step,
    list_steps,
    prepare_dir,
    publish,
    read_info,
    resolve_step,
    step_dir,
)
from fsdp2kit.checkpoint.optim import restore_optimizer, state_kinds
from fsdp2kit.checkpoint.state import model_options, resolve_trainable_only, restore_extra, state_to_load, state_to_save
from fsdp2kit.checkpoint.unpickler import SafeLoadPlanner, SafeReader, read_metadata
from fsdp2kit.weights.adapters import peft_description

# torch < 2.13's DefaultStager closes its copier after every stage, so a second stage of any
# non-tensor state fails (KeyError: <class 'type'>): there, one stager per save.
_STAGER_REUSABLE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)


class Checkpointer:
    """Atomic, resumable checkpoints of a sharded model, its optimizer and anything stateful.

    ::

        ck = fk.Checkpointer("ckpt/", keep_last=2, async_save=False)
        start = ck.load(model, optimizer=opt, extra={"scheduler": sched}) or 0
        for step in range(start + 1, steps + 1):
            ...
            if step % 100 == 0:
                ck.save(step, model, optimizer=opt, extra={"scheduler": sched, "data": {"index": i}})
        ck.wait()

    Every method but `steps` is collective: call it on every rank, in the same order. Errors (a
    bad ``extra`` value, a checkpoint of another model, a corrupt file, a failed write, a rank that
    died) are raised on every rank as `CheckpointError` with the same message, never as a hang.
    An asynchronous Checkpointer makes a gloo group of its own on its first save: make one
    per run, not one per save. Works without any process group too. Format and trade-offs:
    docs/checkpoint-format.md.

    Args:
        root: directory that holds ``step_XXXXXXXX`` subdirectories. One run per root at a time: a
            save deletes the leftovers of interrupted saves.
        keep_last: how many complete steps to keep (``None``: all); the step just saved is never deleted.
        async_save: ``save`` copies the state to CPU buffers (DCP's `DefaultStager`) and returns; a
            background thread writes it and rank 0 publishes it. Saves never overlap. A failure is
            raised at the next ``save``, ``load``, ``wait`` or ``close``, on every rank.
        rng: save every rank's RNG states (`RNGState`) and restore them on load, so a resumed run
            continues exactly as an uninterrupted one.
        trainable_only: leave frozen parameters out of the checkpoint and of what a load expects (a
            LoRA run saves its adapters); ``None``: on when the model has a frozen parameter.
        verify: before a load reads anything into the model, check every record against the CRC-32
            ``torch.save`` stored with it (checks.py): a flipped byte or a torn file is a
            `CheckpointError` naming the file, model and optimizer untouched. Steps saved without
            checksums load unchecked.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep_last: int | None = 2,
        async_save: bool = False,
        *,
        rng: bool = True,
        trainable_only: bool | None = None,
        verify: bool = True,
    ):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None (keep every step) or an int >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self.rng = bool(rng)
        self.trainable_only = trainable_only
        self.verify = bool(verify)
        self.loaded_extra: dict[str, Any] = {}
        """Every ``extra`` value of the last loaded step, decoded (this rank's `PerRank` values unwrapped)."""
        self._group = None  # what DCP and the agreements run on: the default group, or (async) one of its own
        self._pending: tuple[int, Future] | None = None  # an asynchronous save in flight: its step and write
        self._stager: DefaultStager | None = None
        self._writer_thread: ThreadPoolExecutor | None = None  # asynchronous saves run here, one at a time
        self._deleting: list[threading.Thread] = []  # pruned steps are deleted off the critical path
        self._plan_key = f"fsdp2kit.Checkpointer-{uuid.uuid4().hex}"  # DCP's plan cache key: never shared

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.root)!r}, keep_last={self.keep_last}, async_save={self.async_save})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def steps(self) -> list[int]:
        """Complete steps under root, ascending (a file-system look-up, not collective)."""
        return list_steps(self.root)

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None
    ) -> None:
        """Save ``model`` (and ``optimizer``, ``extra``) as ``root/step_{step:08d}``, replacing one there.

        ``extra`` maps names to JSON-able values, tensors, NumPy arrays or objects with
        ``state_dict()``/``load_state_dict()``, whose state is taken now. Values are taken from rank
        0; wrap a value in `PerRank` to keep every rank's own. Names starting with "__" are reserved.
        Returns once the step is published, or (async) once the state is copied.
        """
        check_step(step)
        _check_extra(extra)
        self._finish_pending()
        if self.async_save and self._group is None and active():  # collective: every rank's first save alike
            self._group = new_group()
        rank, world = rank_world()
        error, state, info = None, None, None
        try:
            trainable_only = resolve_trainable_only(model, self.trainable_only)
            state = state_to_save(model, optimizer, extra, rank=rank, rng=self.rng, trainable_only=trainable_only)
            if self.async_save:
                state = self._stage(state)
            if rank == 0:
                info = self._info(step, model, optimizer, extra, world, trainable_only)
        except Exception as e:  # agreed on before DCP starts, so no rank enters it alone
            error = f"rank {rank} could not prepare the state: {describe(e)}"
        if not self.async_save:
            return self._settle(step, lambda: self._write_step(step, model, state, info, error))
        # The rest runs on the writer thread; a failure there is raised on every rank by the next
        # save, load, wait or close, so the ranks never disagree on a save in flight.
        if self._writer_thread is None:
            self._writer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2kit-checkpoint")
        self._pending = (step, self._writer_thread.submit(self._write_step, step, model, state, info, error))

    def wait(self) -> int | None:
        """Finish the asynchronous save in flight, if any, and the background deletion of pruned steps;
        return the save's step (None if none). A failed save is a `CheckpointError` on every rank."""
        try:
            return self._finish_pending()
        finally:
            while self._deleting:
                self._deleting.pop().join()

    def _finish_pending(self) -> int | None:
        """`wait` without waiting for deletions: what save and load need before they start."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._settle(pending[0], pending[1].result)
        return pending[0] if pending else None

    def _settle(self, step: int, write: Callable[[], Any]) -> None:
        """Run ``write`` (or wait for it); a failure on any rank is a `CheckpointError` on every rank."""
        error = None
        try:
            write()
        except CheckpointError:
            raise  # raised by an agreement, so on every rank already
        except FAILURES as e:
            error = describe(e)
        self._agree(error, f"{self._save_kind} of step {step} to {self.root} failed")

    @property
    def _save_kind(self) -> str:
        return "asynchronous save" if self.async_save else "save"

    def close(self) -> None:
        """`wait` for a save in flight and free the CPU staging memory of asynchronous saves."""
        try:
            self.wait()
        finally:
            for name, cache in vars(SavePlanner).items():  # DCP's class-level dicts: drop this Checkpointer's plans
                if name.startswith("_cached_") and isinstance(cache, dict):
                    cache.pop(self._plan_key, None)
            if self._writer_thread is not None:
                self._writer_thread.shutdown(wait=True)
                self._writer_thread = None
            if self._stager is not None:
                self._stager.close()  # frees the staging buffers
                self._stager = None

    def _agree(self, problems: str | list[str] | None, what: str, value: Any = None) -> list[Any]:
        """Every rank's ``value``, or the same `CheckpointError` on every rank if any rank has a problem."""
        return agree(problems, what, value=value, groups=(self._group,), error_type=CheckpointError)

    def _discard(self, paths: Iterable[Path]) -> None:
        """Delete directories renamed out of the way on threads of their own; only `wait` joins them."""
        self._deleting = [t for t in self._deleting if t.is_alive()]
        for path in paths:
            thread = threading.Thread(target=shutil.rmtree, args=(path, True), name="fsdp2kit-prune", daemon=True)
            thread.start()
            self._deleting.append(thread)

    def _info(self, step: int, model, optimizer, extra: dict | None, world: int, trainable_only: bool) -> dict:
        """``fsdp2kit.json``: read by ``fsdp2kit inspect``, and by ``dcp_to_hf(..., base=...)`` for a PEFT model."""
        per_rank = {k for k, v in (extra or {}).items() if isinstance(v, (PerRank, RNGState))}
        return {
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__,
            "world_size": world,
            "async": self.async_save,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "optimizer_state": state_kinds(optimizer) if optimizer is not None else None,
            "extra": sorted(set(extra or {}) - per_rank),
            "extra_per_rank": sorted(per_rank),
            "rng": self.rng,
            "checksums": CHECKSUMS,  # see checks.py
            "trainable_only": trainable_only,
            "peft": peft_description(model) if trainable_only else None,
        }

    def _stage(self, state: dict) -> dict:
        """The state copied into CPU buffers that DCP's stager keeps between saves."""
        if self._stager is not None and not _STAGER_REUSABLE:
            self._stager.close()  # the last save's write is over (_finish_pending)
        if self._stager is None or not _STAGER_REUSABLE:
            # Pinned buffers and non-blocking copies on CUDA (torchtitan's choice); staged
            # before save returns, so the training step after it cannot change what is saved.
            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
            )
            self._stager = DefaultStager(options)
        return self._stager.stage(state)

    def _write_step(self, step: int, model: nn.Module, state: dict, info: dict | None, error: str | None) -> None:
        """Rank 0 makes the temporary directory; once every rank is ready to save the same step, DCP
        writes and rank 0 publishes. On the writer thread (on the Checkpointer's own group) when async."""
        rank, tmp = rank_world()[0], None
        try:
            if rank == 0 and error is None:
                try:
                    tmp = prepare_dir(self.root, step, model, info, self._discard)
                except Exception as e:
                    error = f"rank 0 could not prepare the directory: {describe(e)}"
            what = f"{self._save_kind} of step {step} to {self.root} did not start"
            replies = self._agree(error, what, value=(str(tmp) if tmp else None, step))
            steps = {r[1] for r in replies}
            if len(steps) > 1:
                raise CheckpointError(f"{what}: ranks disagree on the step to save: {sorted(steps)}")
            planner = DefaultSavePlanner(enable_plan_caching=True)
            planner._cached_plans_key = self._plan_key  # two Checkpointers never share a cached plan
            with quiet_dcp(not active()):
                dcp.save(
                    state,
                    # one fsynced file, one writer thread per rank, deliberately (docs/checkpoint-format.md):
                    # spelled out so that a change of DCP's defaults does not change the format
                    storage_writer=FileSystemWriter(
                        replies[0][0], single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False
                    ),
                    planner=planner,
                    process_group=self._group,
                    no_dist=not active(),
                )
            if rank == 0:
                publish(self.root, step, tmp, self.keep_last, self._discard)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        extra: dict | None = None,
    ) -> int | None:
        """Load the newest complete step (or ``step``) into ``model`` (and ``optimizer``, ``extra``).

        Returns the step loaded, or None when ``root`` holds no complete step. The model may be
        sharded differently from the save (any world size or mesh shape, or none). Build the
        optimizer first: its state and hyper-parameters come from the checkpoint. ``extra``: objects
        with ``load_state_dict`` are restored in place, other values replaced in the dict; every
        saved extra value is in ``self.loaded_extra`` afterwards.

        Every rank first checks the metadata against the model (keys, shapes, dtypes, files) and,
        with ``verify``, every record's CRC-32: a problem is a `CheckpointError` on every rank with
        the model and optimizer untouched. A read that fails after that (an I/O error) is raised on
        every rank too, but the model may then hold a mix of old and new values.
        """
        if step is not None:
            check_step(step)
        _check_extra(extra)
        self._finish_pending()
        rank, world = rank_world()

        # Rank 0 chooses the step, so that every rank loads the same one.
        choice, error = None, None
        if rank == 0:
            try:
                choice = resolve_step(self.root, step)
            except Exception as e:
                error = describe(e)
        choice = self._agree(error, f"cannot load from {self.root}", value=choice)[0]
        if choice is None:
            return None
        path = step_dir(self.root, choice)

        upcast: list[str] = []
        try:
            metadata = read_metadata(path)
            trainable_only = resolve_trainable_only(model, self.trainable_only)
            state = state_to_load(model, optimizer, metadata, rank=rank, trainable_only=trainable_only)
            info = read_info(path)
            problems = check_optimizer(info, optimizer)
            problems += check_against(state, metadata, path, optimizer is not None, upcast)
            problems += check_extra_keys(extra, metadata)
            checksums = not problems and self.verify and info.get("checksums") == CHECKSUMS
            problems += verify_files(metadata, path, rank, world, checksums=checksums)
        except Exception as e:
            problems = [describe(e)]
        self._agree(problems, f"cannot load {path}")
        if upcast and rank == 0:
            warnings.warn(
                f"{path} stores {len(upcast)} tensor(s) in a narrower dtype than this model and optimizer keep "
                f"them in (a run with bf16 master weights?); loading them upcast: {fmt_list(upcast, 4)}",
                stacklevel=2,
            )

        error, stage = None, "reading failed: "
        try:
            # Every rank reads its own part without DCP's two collectives (its load planner's global step
            # exchanges nothing a rank needs); a failure on any rank is agreed on below, like a restore's.
            with quiet_dcp(True):
                dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner(), no_dist=True)
            stage = ""  # read: what fails now is the restore
            set_model_state_dict(model, state["model"], options=model_options(trainable_only))
            if optimizer is not None:
                restore_optimizer(model, optimizer, state["optimizer"])
            self.loaded_extra = restore_extra(state["extra"], extra, rank=rank, rng=self.rng)
        except FAILURES as e:
            error = stage + describe(e)
        self._agree(error, f"restoring {path} failed")
        return choice


def _check_extra(extra: Any) -> None:
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of name -> value, got {type(extra).__name__}")
    for key in extra or {}:
        if not isinstance(key, str) or not key or key.startswith("__"):
            raise ValueError(f"extra keys must be non-empty strings not starting with '__', got {key!r}")
