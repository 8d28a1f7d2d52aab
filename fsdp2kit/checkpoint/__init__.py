"""Atomic, resumable, resharding DCP checkpoints: the `Checkpointer` and the on-disk layout it keeps."""

from fsdp2kit.checkpoint.checkpointer import Checkpointer
from fsdp2kit.checkpoint.extras import PerRank, RNGState
from fsdp2kit.checkpoint.layout import (
    CheckpointError,
    incomplete_dirs,
    list_steps,
    resolve_step,
    resolve_step_dir,
    step_dir,
)
from fsdp2kit.checkpoint.unpickler import read_metadata

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "PerRank",
    "RNGState",
    "incomplete_dirs",
    "list_steps",
    "read_metadata",
    "resolve_step",
    "resolve_step_dir",
    "step_dir",
]
