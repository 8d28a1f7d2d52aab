"""Rank agreement, fsdp2kit's one "did any rank fail": a local failure becomes every rank's error
instead of a hang on the others."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from fsdp2kit._internal.dtensor import model_meshes


def agree(
    error: str | list[str] | None,
    what: str,
    *,
    value: Any = None,
    groups: Sequence = (None,),
    error_type: type[Exception] = RuntimeError,
) -> list[Any]:
    """Every rank's ``value`` (by rank) once no rank reported an ``error``; if any did (or the gather
    failed: a rank died), raise ``error_type`` on every rank, naming the ranks and their errors.
    ``groups`` are gathered over in turn (a mesh's dimension groups: every rank of the mesh)."""
    active = dist.is_available() and dist.is_initialized()
    replies = {dist.get_rank() if active else 0: (error, value)}
    for group in groups if active else ():
        parts: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(parts, replies, group=group)
        except Exception as e:
            mine = f"; this rank's own error: {error}" if error else ""
            raise error_type(
                f"{what}: lost contact with the other ranks (a rank died or timed out): {type(e).__name__}: {e}{mine}"
            ) from e
        replies = {r: reply for part in parts for r, reply in part.items()}
    by_message: dict[str, list[int]] = {}
    for r in sorted(replies):
        reply = replies[r][0]
        for message in [reply] if isinstance(reply, str) else reply or []:
            by_message.setdefault(message, []).append(r)
    if by_message:
        lines = []
        for message, ranks in by_message.items():
            every = len(ranks) == len(replies) > 1
            who = "every rank" if every else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            lines.append(f"[{who}] {message}")
        raise error_type(f"{what}:\n  " + "\n  ".join(lines))
    return [replies[r][1] for r in sorted(replies)]


@contextlib.contextmanager
def all_ranks_or_none(model: nn.Module, what: str) -> Iterator[None]:
    """Run a local phase so that it fails on every rank or on none: no rank runs on into a hang.
    A failing rank raises its own exception; the others a RuntimeError naming it."""
    try:
        yield
    except BaseException as e:
        raise_agreed(e, model, what)  # raises e itself, once every rank knows
    raise_agreed(None, model, what)


def raise_agreed(error: BaseException | None, model: nn.Module, what: str) -> None:
    """Raise ``error`` on this rank, or a RuntimeError on every other rank, if any rank failed."""
    message = f"{type(error).__name__}: {error}" if error is not None else None
    meshes = model_meshes(model)  # every rank of the model's mesh
    groups = [meshes[0].get_group(d) for d in range(meshes[0].ndim)] if meshes else []
    with contextlib.suppress(RuntimeError) if error is not None else contextlib.nullcontext():
        agree(message, f"{what} failed", groups=groups)
    if error is not None:
        raise error
