"""Making a save visible: the temporary directory, the atomic rename that publishes a step, pruning."""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.nn as nn

from fsdp2kit.checkpoint.layout import INFO_FILE, TMP_PREFIX, TRASH_PREFIX, fsync, incomplete_dirs, list_steps, step_dir


def prepare_dir(root: Path, step: int, model: nn.Module, info: dict[str, Any], discard: BackgroundDeleter) -> Path:
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


def _delete(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class BackgroundDeleter:
    """Deletes directories out of the way (``.trash-*``, ``.tmp-*``) on threads of its own, off the save's
    critical path (docs/checkpoint-format.md); only `join` waits for them. Deleting one twice is harmless."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def __call__(self, paths: Iterable[Path]) -> None:
        paths = list(paths)
        if paths:
            thread = threading.Thread(target=_delete, args=(paths,), name="fsdp2kit-prune", daemon=True)
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads = []


def publish(root: Path, step: int, tmp: Path, keep_last: int | None, discard: BackgroundDeleter) -> None:
    """Rank 0, after every rank has written: make the step visible with one rename, then prune.
    Directories renamed out of the way go to ``discard``."""
    for path in (tmp / INFO_FILE, tmp / "config.json", tmp):
        if path.exists():
            fsync(path)
    final = step_dir(root, step)
    # Replacing a step takes two renames; a crash between them loses this step number
    # (older steps stay), never leaves a mix of old and new files under it.
    trash = [_move_away(final)] if final.exists() else []
    os.rename(tmp, final)
    fsync(root)
    discard(trash + prune(root, keep_last, just_saved=step))


def prune(root: Path, keep_last: int | None, just_saved: int) -> list[Path]:
    """Rename all but the newest ``keep_last`` steps out of the way, never the one just saved; returns
    them. A failure is a warning: the save is already published."""
    if keep_last is None:
        return []
    steps = list_steps(root)
    keep = set(steps[-keep_last:]) | {just_saved}
    renamed = []
    for old in steps:
        if old in keep:
            continue
        try:  # renamed first: a crash mid-delete must not leave a half-deleted step_* behind
            renamed.append(_move_away(step_dir(root, old)))
        except OSError as e:
            warnings.warn(f"keep_last={keep_last}: could not remove step {old}: {e}", stacklevel=2)
    return renamed


def _move_away(step: Path) -> Path:
    """Rename a step directory to a ``.trash-*`` one beside it, which no listing reads; returns the new path."""
    trash = step.with_name(f"{TRASH_PREFIX}{step.name}-{uuid.uuid4().hex[:8]}")
    os.rename(step, trash)
    return trash
