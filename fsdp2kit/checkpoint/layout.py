"""Where a checkpoint's steps live on disk: step directories, the one step resolver, and publishing a step
(the temporary directory, the atomic rename, pruning)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

STEP_RE = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
METADATA_FILE = ".metadata"
INFO_FILE = "fsdp2kit.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank with the same message."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory a complete ``step`` lives in: ``root/step_{step:08d}``."""
    return Path(root) / f"step_{check_step(step):08d}"


def _dirs(root: str | os.PathLike) -> list[tuple[Path, bool]]:
    """The directories under ``root``, each with whether it is a complete step (``step_*`` with ``.metadata``)."""
    root = Path(root)
    found = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [(p, bool(STEP_RE.match(p.name)) and (p / METADATA_FILE).is_file()) for p in found]


def list_steps(root: str | os.PathLike) -> list[int]:
    """Complete steps (``step_*`` directories holding DCP's ``.metadata``) under ``root``, ascending."""
    return sorted(int(p.name.removeprefix("step_")) for p, complete in _dirs(root) if complete)


def incomplete_dirs(root: str | os.PathLike) -> list[Path]:
    """Directories under ``root`` that are not complete steps: saves in progress or interrupted,
    steps being deleted, and ``step_*`` directories without ``.metadata``."""
    leftover = (TMP_PREFIX, TRASH_PREFIX)
    return [p for p, complete in _dirs(root) if not complete and (p.name.startswith(leftover) or STEP_RE.match(p.name))]


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def fsync(path: Path) -> None:
    """Flush a file to disk, or a directory where the system allows it (not on Windows: the rename is atomic still)."""
    with contextlib.suppress(OSError) if path.is_dir() else contextlib.nullcontext():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_info(path: Path) -> dict:
    """The step's ``fsdp2kit.json`` ({} for a plain DCP checkpoint); an unreadable one is a `CheckpointError`."""
    info = path / INFO_FILE
    if not info.is_file():
        return {}
    try:
        value = json.loads(info.read_text())
        if not isinstance(value, dict):
            raise ValueError(f"a JSON {type(value).__name__}, not an object")
        return value
    except ValueError as e:
        raise CheckpointError(f"{info} is corrupt ({type(e).__name__}: {e})") from e


def resolve_step(root: str | os.PathLike, step: int | None = None) -> int | None:
    """``step`` if it is complete under ``root``, the newest complete step if ``step`` is None,
    None if there is none; a step that is asked for but not complete is a `CheckpointError`."""
    steps = list_steps(root)
    if step is None:
        return steps[-1] if steps else None
    if check_step(step) in steps:
        return step
    where = step_dir(root, step)
    why = "is incomplete (no .metadata: an interrupted save?)" if where.exists() else "does not exist"
    raise CheckpointError(
        f"step {step} is not a complete step in {root}: {where.name} {why}; complete steps: {steps or 'none'}"
    )


def resolve_step_dir(path: str | os.PathLike, step: int | None = None) -> Path:
    """A step directory: ``path`` itself when it holds DCP's ``.metadata``, else the step chosen
    by `resolve_step` under the root ``path``; raises when there is none."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {path}")
    if (path / METADATA_FILE).is_file() and step is None:
        return path
    chosen = resolve_step(path, step)
    if chosen is None:
        found = sorted(p.name for p in path.iterdir())[:10]
        raise FileNotFoundError(
            f"{path} is neither a DCP checkpoint (no .metadata) nor a root with complete step_* directories "
            f"(found {found})"
        )
    return step_dir(path, chosen)


def prepare_dir(root: Path, step: int, model: Any, info: dict, discard: Callable[[Iterable[Path]], None]) -> Path:
    """Rank 0: hand leftovers of interrupted saves to ``discard``, make the temporary directory and
    write ``fsdp2kit.json`` (and the model's HF ``config.json``) into it."""
    root.mkdir(parents=True, exist_ok=True)
    discard(p for p in incomplete_dirs(root) if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)))
    tmp = root / f"{TMP_PREFIX}step_{step:08d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_json_string", None)) and callable(getattr(config, "to_dict", None)):
        # What transformers' save_pretrained writes, so an exporter can rebuild the model.
        (tmp / "config.json").write_text(config.to_json_string())
    return tmp


def publish(root: Path, step: int, tmp: Path, keep_last: int | None, discard: Callable[[list[Path]], None]) -> None:
    """Rank 0, after every rank has written: make the step visible with one rename, then rename all but
    the newest ``keep_last`` steps (never this one) out of the way. What was renamed goes to ``discard``."""
    for path in (tmp / INFO_FILE, tmp / "config.json", tmp):
        if path.exists():
            fsync(path)
    final = step_dir(root, step)
    # Replacing a step takes two renames; a crash between them loses this step number
    # (older steps stay), never leaves a mix of old and new files under it.
    trash = [_move_away(final)] if final.exists() else []
    os.rename(tmp, final)
    fsync(root)
    steps = list_steps(root)
    keep = set(steps if keep_last is None else steps[-keep_last:]) | {step}
    for old in sorted(set(steps) - keep):
        try:  # renamed first: a crash mid-delete must not leave a half-deleted step_* behind
            trash.append(_move_away(step_dir(root, old)))
        except OSError as e:  # the save is published already: a warning
            warnings.warn(f"keep_last={keep_last}: could not remove step {old}: {e}", stacklevel=2)
    discard(trash)


def _move_away(step: Path) -> Path:
    """Rename a step directory to a ``.trash-*`` one beside it, which no listing reads; returns the new path."""
    trash = step.with_name(f"{TRASH_PREFIX}{step.name}-{uuid.uuid4().hex[:8]}")
    os.rename(step, trash)
    return trash
