"""Writing Hugging Face safetensors: files split at a size limit, in a directory that appears complete or not at all."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn as nn

from fsdp2kit._internal.agree import raise_agreed
from fsdp2kit._internal.dtensor import is_first_rank

T = TypeVar("T")


class FirstRankWriter:
    """The mesh's first rank (or, ``alone``, this process) writes into a hidden sibling of ``out_dir``, renamed
    into place by `finish`; its errors are kept (it still joins every gather) and raised on every rank there.
    `add` and `write_index` (in its `do` calls) write safetensors files of at most ``max_bytes``."""

    def __init__(self, model: nn.Module, out_dir: Path, overwrite: bool, what: str, *, max_bytes=0, alone=False):
        self.model, self.out, self.what, self.max = model, Path(out_dir), what, max_bytes
        self.writes = alone or is_first_rank(model)
        self.error: BaseException | None = None
        self.dir: Path | None = None
        self.pending: dict[str, torch.Tensor] = {}  # safetensors files: a new one each time max_bytes would be passed
        self.pending_bytes = self.total = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.do(lambda: self._stage(overwrite))

    def _stage(self, overwrite: bool) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise FileExistsError(f"{self.out} exists and is not a directory")
        if self.out.is_dir() and any(self.out.iterdir()) and not overwrite:
            raise FileExistsError(f"{self.out} exists and is not empty; pass overwrite=True to replace it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.dir = self.out.parent / f".{self.out.name}.partial-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()

    def _commit(self) -> None:
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
            self.out.rename(old)
        self.dir.rename(self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in keys for _, keys in self.parts):
            raise ValueError(f"two tensors would be saved as {name!r}")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        path = self.dir / f".part-{len(self.parts):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def write_index(self) -> None:
        """The pending tensors, then the files under their final names, with the index when there are several."""
        self.flush()
        if not self.parts:
            raise ValueError("nothing to write: the model has no parameters or persistent buffers")
        if len(self.parts) == 1:
            self.parts[0][0].rename(self.dir / "model.safetensors")
            return
        n = len(self.parts)
        weight_map = {}
        for i, (path, keys) in enumerate(self.parts, start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def do(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` on the writing rank, unless an error came first (then kept for `finish`): its result,
        None on the other ranks, after an error, or when it raised."""
        if self.writes and self.error is None:
            try:
                return fn()
            except BaseException as exc:
                self.error = exc
        return None

    def finish(self, last: Callable[[], None] = lambda: None) -> Path | None:
        """Write the ``last`` files and publish; the output directory on the writing rank, None elsewhere."""
        if self.dir is not None:
            self.do(last)
            self.do(self._commit)
            if self.error is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
        raise_agreed(self.error, self.model, self.what)
        return self.out if self.writes else None
