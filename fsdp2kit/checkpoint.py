"""Checkpointer: atomic, resumable, optionally asynchronous DCP checkpoints, resharded on load.

Layout under ``root`` (other tools rely on it):

    root/step_00000100/          a complete step: DCP files (``__<rank>_<n>.distcp``, ``.metadata``),
                                 ``fsdp2kit.json`` (who saved it, when, which keys) and, for a
                                 Hugging Face model, ``config.json``
    root/.tmp-step_00000200-ab12  a save in progress (or one a crash interrupted): never read
    root/.trash-step_...          a step on its way out (pruned or replaced): never read

A save writes into a hidden temporary directory; only after every rank has written its files
(DCP's own final collective says so) does rank 0 fsync and publish it with one atomic
``rename``. So a ``step_*`` directory is complete by construction, and a crash at any moment
leaves the previous step loadable. Pruning renames a step out of the way before deleting it, so
a crash mid-delete never leaves a half-deleted ``step_*`` behind either.

The DCP state dict has three top-level keys: ``model`` (`get_model_state_dict`: full FQNs, each
rank writing only its shards), ``optimizer`` (`get_optimizer_state_dict`, flattened to one key
per parameter and state so it reshards like the model) and ``extra``. Because DCP records the
global shape and the offsets of every chunk, a checkpoint loads at any world size or mesh shape.
Under ``extra``, ``shared.<name>`` holds rank 0's values and ``rank.<r>.<name>`` each rank's
`PerRank` values and RNG states (``__rng__``); every value is ``json`` (a uint8 tensor of JSON
text) plus ``tensors.<i>`` for the tensors it contains.

Nothing from a checkpoint is ever unpickled with arbitrary globals: ``.metadata`` (a pickle, as
DCP writes it) is read with an unpickler that admits only DCP's metadata classes, optimizer
hyper-parameters (DCP stores non-tensors as small pickles) are read with
``torch.load(weights_only=True)``, and ``extra`` is stored as JSON text in a uint8 tensor plus
plain tensors, never as a pickle.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp2kit.plan import fmt_list

try:  # numpy is optional: only its RNG state and arrays in `extra` need it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "PerRank",
    "RNGState",
    "incomplete_dirs",
    "list_steps",
    "read_metadata",
    "step_dir",
]

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_METADATA = ".metadata"
INFO_FILE = "fsdp2kit.json"
_RNG_KEY = "__rng__"
# One key per parameter and optimizer state ("state.<fqn>.exp_avg"): resharding then works key by
# key exactly as for the model, and the checkpoint lists what it holds in plain names.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_MAX_LISTED = 8
# DCP reports a failure on any rank as a CheckpointException, which derives from BaseException.
_FAILURES = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank with the same message."""


# --------------------------------------------------------------------------------------------
# Layout


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory a complete ``step`` lives in: ``root/step_{step:08d}``."""
    return Path(root) / f"step_{_check_step(step):08d}"


def list_steps(root: str | os.PathLike) -> list[int]:
    """Complete steps under ``root``, ascending; ``[]`` when there are none or no ``root``.

    Complete means a ``step_*`` directory holding DCP's ``.metadata``: temporary and trash
    directories, and anything else, are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir() and (entry / _METADATA).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def incomplete_dirs(root: str | os.PathLike) -> list[Path]:
    """Directories under ``root`` that are not complete steps: saves in progress or interrupted,
    steps being deleted, and ``step_*`` directories without ``.metadata``."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        interrupted = _STEP_RE.match(entry.name) and not (entry / _METADATA).is_file()
        if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) or interrupted:
            found.append(entry)
    return found


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


# --------------------------------------------------------------------------------------------
# Reading without unpickling arbitrary objects

# What DCP's .metadata pickle refers to. Anything else in that file is refused, not run.
_METADATA_GLOBALS = (
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    }
    | {
        (mod, cls)
        for mod in ("pathlib", "pathlib._local")
        for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a type DCP metadata is made of")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """DCP metadata of the checkpoint directory ``path``, read with an allow-list unpickler.

    DCP's own reader calls ``pickle.load`` on ``.metadata``, which runs any code a tampered file
    names; this one admits only the classes DCP metadata consists of. Needs no process group.
    """
    file = Path(path) / _METADATA
    if not file.is_file():
        raise CheckpointError(f"{path} has no {_METADATA}: not a complete DCP checkpoint")
    try:
        with open(file, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except Exception as e:
        raise CheckpointError(f"{file} is corrupt or not DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values (optimizer hyper-parameters) are read
    with ``weights_only=True``: the default unpickles them with ``weights_only=False``."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _AlreadyStaged(AsyncStager):
    """Hands dcp.async_save a state dict the Checkpointer has staged (copied) itself."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# `extra`: JSON text plus tensors, per rank where asked


class PerRank:
    """Marks an ``extra`` value that differs by rank (a data-loader position, a sampler state).

    Plain ``extra`` values are taken from rank 0 (they are meant to be the same everywhere);
    a ``PerRank`` value is stored once per rank and each rank loads its own. At a different world
    size, ranks that did not exist at save time keep their current value, with a warning.
    An `RNGState` is always per rank, wrapped or not.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


class RNGState:
    """The calling process's random generators as a stateful object: torch CPU, every CUDA device
    (when CUDA is initialised), Python's ``random`` and NumPy's global generator.

    `Checkpointer` saves one per rank by default (``rng=True``), so a resumed run draws the same
    dropout masks and random data as one that was never interrupted. Put one in ``extra`` (it is
    stored per rank, like a `PerRank` value) to also save it with ``rng=False`` or to name it.
    """

    def state_dict(self) -> dict:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "name": name,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            saved = state["cuda"]
            for device in range(min(len(saved), torch.cuda.device_count())):
                torch.cuda.set_rng_state(saved[device], device)
        if "numpy" in state and np is not None:
            s = state["numpy"]
            np.random.set_state(
                (s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
            )


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _to_tree(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """``value`` as JSON-able data; tensors go to ``tensors`` and leave a placeholder.

    Tuples, non-string dict keys and NumPy arrays are tagged so they come back as they went in.
    Plain dicts never carry a key starting with "__", so a tag cannot be confused with data.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, DTensor):
        raise TypeError(
            f"{where} is a DTensor: sharded state belongs in the model or the optimizer, which are "
            "saved shard by shard; extra holds small replicated or per-rank values"
        )
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {"__tensor__": len(tensors) - 1}
    if np is not None and isinstance(value, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(value)).clone())
        return {"__ndarray__": len(tensors) - 1}
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_to_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_to_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _to_tree(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "__items__": [
                [_to_tree(k, tensors, f"{where} key"), _to_tree(v, tensors, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    hint = " (a nested object with state_dict(): put it at the top level of extra)" if _is_stateful(value) else ""
    raise TypeError(
        f"{where} is a {type(value).__qualname__}, which a checkpoint does not store{hint}. extra takes "
        "JSON-able values (dict, list, tuple, str, int, float, bool, None), tensors, NumPy arrays, and "
        "top-level objects with state_dict()/load_state_dict()"
    )


def _from_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, list):
        return [_from_tree(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, inner),) = tree.items()
        if tag == "__tensor__":
            return tensors[str(inner)]
        if tag == "__ndarray__":
            return tensors[str(inner)].numpy()
        if tag == "__tuple__":
            return tuple(_from_tree(v, tensors) for v in inner)
        if tag == "__items__":
            return {_hashable(_from_tree(k, tensors)): _from_tree(v, tensors) for k, v in inner}
    return {k: _from_tree(v, tensors) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _encode(value: Any, where: str) -> dict:
    """One ``extra`` entry as DCP leaves: {"json": uint8 tensor, "tensors": {"0": ..., ...}}."""
    tensors: list[torch.Tensor] = []
    if _is_stateful(value):
        value = value.state_dict()
    text = json.dumps(_to_tree(value, tensors, where), allow_nan=True, separators=(",", ":"))
    entry: dict[str, Any] = {"json": torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)}
    if tensors:
        entry["tensors"] = {str(i): t for i, t in enumerate(tensors)}
    return entry


def _decode(entry: dict) -> Any:
    text = bytes(entry["json"].numpy()).decode()
    return _from_tree(json.loads(text), entry.get("tensors", {}))


def _extra_entries(metadata: Metadata, prefix: tuple[str, ...]) -> dict[str, dict]:
    """Templates for the ``extra`` entries stored under ``prefix`` (e.g. ("extra", "shared")),
    built from the metadata alone: {key: {"json": empty uint8, "tensors": {...}}}."""
    paths = _paths(metadata)
    entries: dict[str, dict] = {}
    for flat, path in paths.items():
        if tuple(path[: len(prefix)]) != prefix or len(path) < len(prefix) + 2:
            continue
        md = metadata.state_dict_metadata[flat]
        if not isinstance(md, TensorStorageMetadata):
            continue
        key, rest = path[len(prefix)], path[len(prefix) + 1 :]
        empty = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        entry = entries.setdefault(key, {})
        if rest == ("json",):
            entry["json"] = empty
        elif len(rest) == 2 and rest[0] == "tensors":
            entry.setdefault("tensors", {})[rest[1]] = empty
    return {k: v for k, v in entries.items() if "json" in v}


def _paths(metadata: Metadata) -> dict[str, tuple]:
    """Flat DCP key -> path of keys in the saved nested state dict."""
    if isinstance(metadata.planner_data, dict):
        return {
            k: tuple(str(p) for p in v) for k, v in metadata.planner_data.items() if k in metadata.state_dict_metadata
        }
    return {k: tuple(k.split(".")) for k in metadata.state_dict_metadata}


# --------------------------------------------------------------------------------------------
# Collectives of the checkpointer's own


class _Comm:
    """The checkpointer's object collectives, and the group DCP coordinates on.

    Synchronous saves and loads use the default group: everything runs on the calling thread,
    between training steps. Asynchronous saves get a gloo group of their own: DCP's collectives
    then run on a background thread while training runs FSDP's on the default group, and one
    group used by two threads at once would interleave their messages. Gloo, because DCP
    exchanges only plans (Python objects) and async_save requires a CPU backend, so this also
    works when the default group is NCCL. It inherits the default group's timeout, so a dead
    rank becomes an error within that time, not a hang.
    """

    def __init__(self, own_group: bool) -> None:
        self.own_group = own_group
        self.group = None
        self._ready = False

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.active else 0

    @property
    def world(self) -> int:
        return dist.get_world_size() if self.active else 1

    def setup(self) -> None:
        """Collective the first time (it may create a group): every rank calls it at the same point."""
        if self.active and not self._ready:
            if self.own_group:
                self.group = dist.new_group(backend="gloo", timeout=_default_timeout())
            self._ready = True

    def gather(self, obj: Any, what: str, local_error: Any = None) -> list[Any]:
        """Every rank's ``obj``; a rank that died or timed out becomes a CheckpointError here."""
        if not self.active:
            return [obj]
        self.setup()
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:
            mine = f"; this rank's own error: {local_error}" if local_error else ""
            raise CheckpointError(
                f"{what}: lost contact with the other ranks (a rank died or timed out): {_describe(e)}{mine}"
            ) from e
        return out

    def agree(self, problems: str | list[str] | None, what: str) -> None:
        """Raise the same CheckpointError on every rank if any rank has a problem."""
        _raise_gathered(self.gather(problems, what, problems), what)


def _default_timeout():
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # private API moved: gloo's own default (30 minutes)
        return None


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _raise_gathered(replies: list[str | list[str] | None], what: str) -> None:
    """Raise one CheckpointError on every rank if any rank reported a problem."""
    by_message: dict[str, list[int]] = {}
    for rank, reply in enumerate(replies):
        for message in [reply] if isinstance(reply, str) else reply or []:
            by_message.setdefault(message, []).append(rank)
    if not by_message:
        return
    world = len(replies)
    parts = []
    for message, ranks in by_message.items():
        who = (
            "every rank"
            if len(ranks) == world and world > 1
            else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        )
        parts.append(f"[{who}] {message}")
    raise CheckpointError(f"{what}:\n  " + "\n  ".join(parts))


def _quiet_without_process_group(active: bool) -> None:
    """Without a process group DCP works in-process but warns on every save and load that it
    assumes so, from its writer thread too, where no catch_warnings reaches. That is exactly
    what is meant here, so this one message is filtered (an identical filter replaces, not
    accumulates), and only once it can occur."""
    if not active:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported (e.g. Windows): the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------------------------
# The Checkpointer


class _Pending:
    def __init__(self, step: int, tmp: Path, done: Future):
        self.step, self.tmp, self.done = step, tmp, done


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
    bad value in ``extra``, a checkpoint of another model, a corrupt file, a failed write) are
    raised on every rank as `CheckpointError` with the same message, never as a hang on the
    ranks that did not see the problem. A rank that dies mid-save turns into a CheckpointError
    on the others within the process group's timeout.

    Synchronous saves and loads coordinate on the default process group; an asynchronous
    Checkpointer makes a gloo group of its own on first use (see `_Comm` for why), so make one
    per run, not one per save. Works without any process group too (one process).

    Args:
        root: directory that holds ``step_XXXXXXXX`` subdirectories; created on the first save.
            One training run (one Checkpointer) per root at a time: a save deletes the leftovers
            of interrupted saves, which another writer's save in flight would look like.
        keep_last: how many complete steps to keep; older ones are deleted only after a newer
            one is complete, and the step just saved is never deleted. ``None`` keeps all.
        async_save: ``save`` copies the state to CPU memory and returns; a background thread
            writes it and rank 0 publishes the step when every rank is done. The training loop
            then stalls only for the copy, not the write, at the price of one extra copy of the
            sharded state in CPU memory (kept between saves so it is not reallocated each time)
            and of disk traffic that competes with training. Saves never overlap: a save waits
            for the one before. A failed asynchronous save raises at the next ``save``, ``load``,
            ``wait`` or ``close``.
        rng: save every rank's RNG states (torch, CUDA, Python, NumPy; see `RNGState`) and
            restore them on load, so a resumed run continues exactly as an uninterrupted one.
            Ranks that did not exist at save time keep their generators.
    """

    def __init__(
        self, root: str | os.PathLike, keep_last: int | None = 2, async_save: bool = False, *, rng: bool = True
    ):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None (keep every step) or an int >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self.rng = bool(rng)
        self.loaded_extra: dict[str, Any] = {}
        """Every ``extra`` value of the last loaded step, decoded (this rank's `PerRank` values unwrapped)."""
        self._comm = _Comm(own_group=self.async_save)
        self._pending: _Pending | None = None
        self._stager: DefaultStager | None = None

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.root)!r}, keep_last={self.keep_last}, async_save={self.async_save})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- queries ---------------------------------------------------------------------------

    @property
    def steps(self) -> list[int]:
        """Complete steps under root, ascending (a file-system look-up, not collective)."""
        return list_steps(self.root)

    # ---- save ------------------------------------------------------------------------------

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None
    ) -> None:
        """Save ``model`` (and ``optimizer``, ``extra``) as ``root/step_{step:08d}``.

        ``extra`` maps names to JSON-able values, tensors, NumPy arrays or objects with
        ``state_dict()``/``load_state_dict()`` (a scheduler, a stateful data loader), whose state
        is taken now. Values are taken from rank 0; wrap a value in `PerRank` to keep every
        rank's own. Names starting with "__" are reserved.

        Saving a step that already exists replaces it (the old one is moved aside first).
        Synchronous: returns once the step is published on disk. Asynchronous: returns once the
        state is copied; `wait` publishes it.
        """
        _check_step(step)
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict of name -> value, got {type(extra).__name__}")
        for key in extra or {}:
            if not isinstance(key, str) or not key or key.startswith("__"):
                raise ValueError(f"extra keys must be non-empty strings not starting with '__', got {key!r}")
        self.wait()
        comm = self._comm
        comm.setup()
        rank = comm.rank

        error, tmp, state = None, None, None
        try:
            state = self._state_to_save(model, optimizer, extra)
            if self.async_save:
                state = self._stage(state)
            if rank == 0:
                tmp = self._prepare_dir(step, model, optimizer, extra, comm.world)
        except Exception as e:  # reported to every rank below, so none enters DCP alone
            error = f"rank {rank} could not prepare the state: {_describe(e)}"
        what = f"save of step {step} to {self.root} did not start"
        replies = comm.gather((error, str(tmp) if tmp else None, step), what, error)
        steps = sorted({r[2] for r in replies})
        if len(steps) > 1:
            replies[0] = (f"ranks disagree on the step to save: {steps}", *replies[0][1:])
        if any(r[0] for r in replies):
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            _raise_gathered([r[0] for r in replies], what)
        tmp = Path(replies[0][1])

        writer = FileSystemWriter(tmp, sync_files=True, overwrite=False)
        if self.async_save:
            _quiet_without_process_group(comm.active)
            try:
                upload = dcp.async_save(
                    state,
                    storage_writer=writer,
                    planner=DefaultSavePlanner(),
                    process_group=comm.group,
                    async_stager=_AlreadyStaged(),
                    no_dist=not comm.active,
                )
            except _FAILURES as e:  # before any collective: the other ranks' writers fail at wait()
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(
                    f"asynchronous save of step {step} to {self.root} did not start: {_describe(e)}"
                ) from e
            self._pending = _Pending(step, tmp, self._chain_publish(upload, step, tmp, rank))
            return

        error = None
        try:
            _quiet_without_process_group(comm.active)
            dcp.save(
                state,
                storage_writer=writer,
                planner=DefaultSavePlanner(),
                process_group=comm.group,
                no_dist=not comm.active,
            )
            if rank == 0:
                self._publish(step, tmp)
        except _FAILURES as e:
            error = _describe(e)
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        comm.agree(error, f"save of step {step} to {self.root} failed")

    def wait(self) -> int | None:
        """Finish the asynchronous save in flight, if any; return its step (None if none).

        Raises `CheckpointError` on every rank if it failed on any; the step is then not
        published and the previous one stays the newest.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = None
        try:
            pending.done.result()
        except BaseException as e:
            error = _describe(e)
        self._comm.agree(error, f"asynchronous save of step {pending.step} to {self.root} failed")
        return pending.step

    def close(self) -> None:
        """`wait` for a save in flight and free the CPU staging memory of asynchronous saves."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _state_to_save(self, model: nn.Module, optimizer, extra: dict | None) -> dict:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
        rank = self._comm.rank
        shared, mine = {}, {}
        for key, value in (extra or {}).items():
            if isinstance(value, (PerRank, RNGState)):
                mine[key] = _encode(value.value if isinstance(value, PerRank) else value, f"extra[{key!r}]")
            else:
                # Encoded on every rank so that a bad value fails on every rank alike, but stored
                # from rank 0 only: DCP would otherwise keep an arbitrary rank's copy.
                entry = _encode(value, f"extra[{key!r}]")
                if rank == 0:
                    shared[key] = entry
        if self.rng:
            mine[_RNG_KEY] = _encode(RNGState(), "RNG state")
        state["extra"] = {"shared": shared, "rank": {str(rank): mine}}
        return state

    def _stage(self, state: dict) -> dict:
        """Copy the state to CPU memory that later saves reuse (pinned on CUDA)."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        return self._stager.stage(state)

    def _prepare_dir(self, step: int, model: nn.Module, optimizer, extra: dict | None, world: int) -> Path:
        """Rank 0: clear leftovers of interrupted saves, make the temporary directory and write
        the small files that ride along with the DCP files."""
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in incomplete_dirs(self.root):
            if leftover.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(leftover, ignore_errors=True)
        tmp = self.root / f"{_TMP_PREFIX}step_{step:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        info = {
            "step": step,
            "world_size": world,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__,
            "async": self.async_save,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "extra": sorted(k for k, v in (extra or {}).items() if not isinstance(v, (PerRank, RNGState))),
            "extra_per_rank": sorted(k for k, v in (extra or {}).items() if isinstance(v, (PerRank, RNGState))),
            "rng": self.rng,
        }
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        config = getattr(model, "config", None)
        if callable(getattr(config, "to_json_string", None)) and callable(getattr(config, "to_dict", None)):
            # What transformers' save_pretrained writes, so an exporter can rebuild the model.
            (tmp / "config.json").write_text(config.to_json_string())
        return tmp

    def _chain_publish(self, upload: Future, step: int, tmp: Path, rank: int) -> Future:
        """A future that completes once the background write is done and rank 0 has published
        it. Publishing from the writer thread makes the step durable as soon as it is written,
        even if the training loop never calls wait()."""
        done: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()
                if rank == 0:
                    self._publish(step, tmp)
                done.set_result(step)
            except BaseException as e:  # kept for wait(): never lost in a callback
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                done.set_exception(e)

        upload.add_done_callback(finish)
        return done

    def _publish(self, step: int, tmp: Path) -> None:
        """Rank 0, after every rank has written: make the step visible with one rename, then prune."""
        for name in (INFO_FILE, "config.json"):
            if (tmp / name).exists():
                _fsync_file(tmp / name)
        _fsync_dir(tmp)
        final = step_dir(self.root, step)
        trash = None
        if final.exists():
            # Replacing a step takes two renames; a crash between them loses this step number
            # (older steps stay), never leaves a mix of old and new files under it.
            trash = self.root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._prune(just_saved=step)

    def _prune(self, just_saved: int) -> None:
        """Delete all but the newest ``keep_last`` steps, never the one just saved. A failure
        here is a warning: the save itself is complete and published."""
        if self.keep_last is None:
            return
        steps = list_steps(self.root)
        keep = set(steps[-self.keep_last :]) | {just_saved}
        for old in steps:
            if old in keep:
                continue
            # Renamed first: a crash mid-delete must not leave a half-deleted step_* behind.
            trash = self.root / f"{_TRASH_PREFIX}step_{old:08d}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(step_dir(self.root, old), trash)
            except OSError as e:
                warnings.warn(f"keep_last={self.keep_last}: could not remove step {old}: {e}", stacklevel=2)
                continue
            shutil.rmtree(trash, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        extra: dict | None = None,
    ) -> int | None:
        """Load the newest complete step (or ``step``) into ``model`` (and ``optimizer``, ``extra``).

        Returns the step loaded, or None when ``root`` holds no complete step (a fresh start).
        The model may be sharded differently from the save: another world size, uneven shards,
        a 2-D HSDP mesh instead of a 1-D one or back, or no sharding at all in one process.
        Build the optimizer before loading; its state and hyper-parameters (learning rate
        included) come from the checkpoint.

        ``extra``: the same kind of dict as for `save`. Objects with ``load_state_dict`` are
        restored in place; other values are replaced in the dict. Every value of the checkpoint's
        extra, asked for or not, is in ``self.loaded_extra`` afterwards (tensors on the CPU).

        Before anything is read, every rank checks the checkpoint's metadata against the model:
        missing or unexpected keys, shapes, dtypes, missing or truncated files, and raises
        `CheckpointError` naming them, on every rank. If reading fails after that (an I/O error),
        the error is raised too, but the model may then hold a mix of old and new values.
        """
        if step is not None:
            _check_step(step)
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict of name -> value, got {type(extra).__name__}")
        self.wait()
        comm = self._comm
        comm.setup()

        # Rank 0 chooses the step, so that every rank loads the same one.
        choice, error = None, None
        if comm.rank == 0:
            try:
                choice = self._choose(step)
            except Exception as e:
                error = _describe(e)
        what = f"cannot load from {self.root}"
        replies = comm.gather((choice, error), what, error)
        _raise_gathered([r[1] for r in replies], what)
        choice = replies[0][0]
        if choice is None:
            return None
        path = step_dir(self.root, choice)

        problems: list[str] = []
        state: dict[str, Any] = {}
        try:
            metadata = read_metadata(path)
            state = self._state_to_load(model, optimizer, metadata)
            problems = _check_against(state, metadata, path, optimizer is not None) + _check_files(metadata, path)
            problems += _check_extra_keys(extra, metadata)
        except Exception as e:
            problems = [_describe(e)]
        comm.agree(problems, f"cannot load {path}")

        try:
            _quiet_without_process_group(comm.active)
            dcp.load(
                state,
                storage_reader=_SafeReader(path),
                planner=_SafeLoadPlanner(allow_partial_load=False),
                process_group=comm.group,
                no_dist=not comm.active,
            )
        except _FAILURES as e:  # DCP raises on every rank when any rank fails to read
            raise CheckpointError(f"reading {path} failed: {_describe(e)}") from e

        error = None
        try:
            set_model_state_dict(model, state["model"])
            if optimizer is not None:
                set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_OPTIM_OPTIONS)
            self._restore_extra(state["extra"], extra)
        except Exception as e:
            error = _describe(e)
        comm.agree(error, f"restoring {path} failed")
        return choice

    def _choose(self, step: int | None) -> int | None:
        steps = list_steps(self.root)
        if step is None:
            return steps[-1] if steps else None
        if step in steps:
            return step
        where = step_dir(self.root, step)
        why = "is incomplete (no .metadata: an interrupted save?)" if where.exists() else "does not exist"
        raise CheckpointError(f"step {step}: {where} {why}; complete steps in {self.root}: {steps or 'none'}")

    def _state_to_load(self, model: nn.Module, optimizer, metadata: Metadata) -> dict:
        """The state dict DCP fills in place: the model's own (sharded) tensors, the optimizer's,
        and templates for ``extra`` shaped after the metadata."""
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
        rank = str(self._comm.rank)
        state["extra"] = {
            "shared": _extra_entries(metadata, ("extra", "shared")),
            "rank": {rank: _extra_entries(metadata, ("extra", "rank", rank))},
        }
        return state

    def _restore_extra(self, loaded: dict, extra: dict | None) -> None:
        values = {k: _decode(v) for k, v in loaded["shared"].items()}
        mine = {k: _decode(v) for k, v in next(iter(loaded["rank"].values())).items()}
        rng = mine.pop(_RNG_KEY, None)
        values.update(mine)
        self.loaded_extra = values
        if extra:
            missing_here = []
            for key, target in extra.items():
                inner = target.value if isinstance(target, PerRank) else target
                if key not in values:
                    missing_here.append(key)  # only PerRank values get here: checked before loading
                elif _is_stateful(inner):
                    inner.load_state_dict(values[key])
                else:
                    extra[key] = PerRank(values[key]) if isinstance(target, PerRank) else values[key]
            if missing_here:
                warnings.warn(
                    f"rank {self._comm.rank} has no saved value for per-rank extra {missing_here} (the checkpoint "
                    "was saved by fewer ranks); keeping the current values",
                    stacklevel=3,
                )
        if self.rng:
            if rng is not None:
                RNGState().load_state_dict(rng)
            else:
                warnings.warn(
                    f"rank {self._comm.rank}: the checkpoint holds no RNG state for this rank (saved by fewer ranks, "
                    "or with rng=False); its random generators are left as they are",
                    stacklevel=3,
                )


# --------------------------------------------------------------------------------------------
# Checks before loading


def _check_against(state: dict, metadata: Metadata, path: Path, with_optimizer: bool) -> list[str]:
    """What stands between this state dict and the checkpoint, in sentences that name the keys."""
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict({k: v for k, v in state.items() if k != "extra"})
    missing, kind, shape, dtype = [], [], [], []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            missing.append(key)
        elif isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                kind.append(f"{key} (checkpoint: not a tensor)")
            elif tuple(md.size) != tuple(value.shape):
                shape.append(f"{key}: checkpoint {tuple(md.size)}, here {tuple(value.shape)}")
            elif md.properties.dtype != value.dtype:
                dtype.append(f"{key}: checkpoint {md.properties.dtype}, here {value.dtype}")
        elif not isinstance(md, BytesStorageMetadata):
            kind.append(f"{key} (checkpoint: a tensor, here a {type(value).__name__})")
    prefixes = ("model.", "optimizer.") if with_optimizer else ("model.",)
    unexpected = [k for k in saved if k.startswith(prefixes) and k not in flat]

    problems = []
    if with_optimizer and not any(k.startswith("optimizer.") for k in saved):
        problems.append(
            f"{path.name} was saved without optimizer state: load it with optimizer=None to start the optimizer afresh"
        )
        missing = [k for k in missing if not k.startswith("optimizer.")]
    if missing:
        problems.append(f"{len(missing)} key(s) missing from the checkpoint: {fmt_list(missing, _MAX_LISTED)}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} key(s) in the checkpoint that this model/optimizer lacks: "
            f"{fmt_list(unexpected, _MAX_LISTED)}"
        )
    if shape:
        problems.append(f"shape mismatch: {fmt_list(shape, _MAX_LISTED)}")
    if dtype:
        problems.append(f"dtype mismatch: {fmt_list(dtype, _MAX_LISTED)}")
    if kind:
        problems.append(f"tensor/non-tensor mismatch: {fmt_list(kind, _MAX_LISTED)}")
    if missing or unexpected or shape:
        problems.append("is this a checkpoint of another model (or another optimizer)?")
    return problems


def _check_files(metadata: Metadata, path: Path) -> list[str]:
    """Every file the metadata points into exists and is long enough."""
    if not isinstance(metadata.storage_data, dict):
        return []
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), info.offset + info.length)
    problems = []
    for rel, end in sorted(needed.items()):
        file = path / rel
        if not file.is_file():
            problems.append(f"data file {file} is missing")
        elif file.stat().st_size < end:
            problems.append(f"data file {file} is truncated ({file.stat().st_size} bytes, metadata needs {end})")
    return problems


def _check_extra_keys(extra: dict | None, metadata: Metadata) -> list[str]:
    """Every key asked for was saved: shared ones by rank 0, per-rank ones by at least one rank
    (a rank that did not exist at save time keeps its value, see PerRank)."""
    if not extra:
        return []
    shared, per_rank = set(), set()
    for path in _paths(metadata).values():
        if path[:2] == ("extra", "shared") and len(path) > 2:
            shared.add(path[2])
        elif path[:2] == ("extra", "rank") and len(path) > 3 and path[3] != _RNG_KEY:
            per_rank.add(path[3])
    missing = [
        k for k, v in extra.items() if k not in (per_rank | shared if isinstance(v, (PerRank, RNGState)) else shared)
    ]
    if missing:
        have = sorted(shared) + [f"{k} (per rank)" for k in sorted(per_rank)]
        return [f"extra key(s) {missing} not in the checkpoint, which has {have or 'no extra'}"]
    return []
