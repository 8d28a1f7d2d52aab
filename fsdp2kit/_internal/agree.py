"""Rank agreement: a local failure becomes every rank's error instead of a hang on the others."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2kit._internal.dtensor import model_meshes


def agree_failed(failed: bool, model: nn.Module) -> bool:
    """Whether any rank of the model's mesh failed: a local error becomes every rank's error."""
    meshes = model_meshes(model)
    if not meshes or not dist.is_initialized():
        return failed
    mesh = meshes[0]
    flag = torch.tensor([1 if failed else 0], device=mesh.device_type)
    for d in range(mesh.ndim):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
    return bool(flag.item())


@contextlib.contextmanager
def all_ranks_or_none(model: nn.Module, what: str) -> Iterator[None]:
    """Run a local phase so that it fails on every rank or on none: no rank runs on into a hang."""
    try:
        yield
    except BaseException:
        agree_failed(True, model)
        raise
    if agree_failed(False, model):
        raise RuntimeError(f"{what} failed on another rank (see that rank's error); nothing is usable here")


def raise_agreed(error: BaseException | None, model: nn.Module, what: str) -> None:
    """Raise ``error`` on this rank, or a RuntimeError on every other rank, if any rank failed."""
    if agree_failed(error is not None, model):
        if error is not None:
            raise error
        raise RuntimeError(f"{what} failed on another rank (see its error)")
