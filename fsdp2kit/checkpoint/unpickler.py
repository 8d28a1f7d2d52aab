"""Reading DCP checkpoints without unpickling arbitrary objects: an allow-list for `.metadata` and a safe planner."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fsdp2kit.checkpoint.layout import METADATA_FILE, CheckpointError

# What DCP's .metadata pickle refers to: the classes of DCP's metadata module (dataclasses and an enum,
# whichever a torch version has), and these. Anything else in that file is refused, not run.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
_METADATA_GLOBALS = {
    *((module, name) for module in ("pathlib", "pathlib._local") for name in _PATHS),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if module == _METADATA_MODULE and "." not in name:  # a dotted name would walk attributes
            found = super().find_class(module, name)  # a module torch has imported
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a type DCP metadata is made of")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """DCP metadata of the checkpoint directory ``path``, unpickled admitting only DCP's metadata classes
    (DCP's own ``pickle.load`` runs whatever a tampered file names). Needs no process group."""
    file = Path(path) / METADATA_FILE
    if not file.is_file():
        raise CheckpointError(f"{path} has no {METADATA_FILE}: not a complete DCP checkpoint")
    try:
        with open(file, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except Exception as e:
        raise CheckpointError(f"{file} is corrupt or not DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's `FileSystemReader` with the ``metadata`` `read_metadata` (the allow-list) returned for ``path``."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values (optimizer hyper-parameters) are read
    with ``weights_only=True``: the default unpickles them with ``weights_only=False``."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
