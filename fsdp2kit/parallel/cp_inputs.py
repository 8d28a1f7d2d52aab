"""A sequence's layout over the cp ranks, and a batch split that way (docs/long-sequences.md, The inputs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_seq", "chunk_order", "document_mask", "split_for_context_parallel", "sub_mesh"]


def chunk_order(cp: int) -> list[int]:
    """The sequence's ``2 * cp`` chunks in the order the cp ranks hold them, rank 0's two first."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def sub_mesh(mesh: DeviceMesh, what: str, dim: str = "cp", required: bool = False) -> DeviceMesh | None:
    """The 1-D ``dim`` sub-mesh of ``mesh``; without one, None or (``required``) a ``ValueError`` naming ``what``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a DeviceMesh (see fsdp2kit.make_mesh), got {type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    if dim in names:
        return mesh if len(names) == 1 else mesh[dim]
    if required:
        raise ValueError(
            f"{what} needs a mesh with a {dim!r} dimension, got {names or mesh.shape}; make it with "
            f"fsdp2kit.make_mesh(shard=..., {dim}=...)"
        )
    return None


def check_seq(what: str, length: int, cp: int) -> None:
    """``ValueError`` (starting with ``what``) unless ``length`` cuts into ``2 * cp`` equal chunks (planner's too)."""
    if cp > 1 and length % (2 * cp):
        raise ValueError(
            f"{what} does not divide into 2 x cp = {2 * cp} equal chunks (each cp rank holds a head and a tail "
            f"chunk of every sequence); pad to a multiple of {2 * cp}, e.g. seq_len {-(-length // (2 * cp)) * 2 * cp}"
        )


def _split(t: torch.Tensor, cp: int, rank: int, seq_dim: int, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"split_for_context_parallel: {name} must be a tensor, got {type(t).__name__}")
    length = t.shape[seq_dim]
    check_seq(f"split_for_context_parallel: {name}'s {length} positions along dim {seq_dim}", length, cp)
    chunks = t.unflatten(seq_dim, (2 * cp, length // (2 * cp)))
    index = torch.tensor([rank, 2 * cp - 1 - rank], device=t.device)
    return chunks.index_select(seq_dim, index).flatten(seq_dim, seq_dim + 1).contiguous()


def split_for_context_parallel(batch, mesh: DeviceMesh, *, seq_dim: int = 1):
    """This cp rank's part of a batch: each tensor cut along ``seq_dim`` into ``2 * cp`` chunks, of which cp rank
    ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` (docs/long-sequences.md, section The inputs).

    Call it on every rank of a cp group with the same whole sequences. ``batch``: a tensor, a tuple/list of
    tensors or a mapping (the same kind comes back); a mapping without ``"position_ids"`` gets them (one document
    per row) before the split: pass them to the model. An ``"attention_mask"`` is refused, as is a length that does
    not divide by ``2 * cp``. Shift labels *before* the split and compute the loss from the logits. A mesh without
    a ``"cp"`` dimension returns the batch unchanged.
    """
    sub = sub_mesh(mesh, "split_for_context_parallel")
    if sub is None:
        return batch
    cp, rank = sub.size(), sub.get_local_rank()
    if isinstance(batch, torch.Tensor):
        return _split(batch, cp, rank, seq_dim, "the tensor")
    if isinstance(batch, Mapping):
        items = dict(batch)
        if "attention_mask" in items:
            raise ValueError(
                "split_for_context_parallel: an attention_mask (padding) is not supported under context parallelism; "
                "keep documents apart with position_ids that restart at 0 (packing) and ignore padding in the labels"
            )
        if "position_ids" not in items and "input_ids" in items:
            ids = items["input_ids"].movedim(seq_dim, -1)  # 0, 1, 2, ... along the sequence
            items["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids).movedim(-1, seq_dim)
        return {k: _split(v, cp, rank, seq_dim, repr(k)) for k, v in items.items()}
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(_split(t, cp, rank, seq_dim, f"item {i}") for i, t in enumerate(batch))
    raise TypeError(f"split_for_context_parallel: batch must be a tensor, a sequence or a mapping of tensors, "
                    f"got {type(batch).__name__}")  # fmt: skip


def document_mask(positions: torch.Tensor, causal: bool = True) -> torch.Tensor | None:
    """(batch, 1, seq, seq) bool: key j is in query i's document (starting where ``positions`` do not continue
    by one) and, if ``causal``, j <= i. None when each row is one document and ``causal`` (the kernel's flag)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if causal and not bool(starts[:, 1:].any()):
        return None
    doc = starts.cumsum(dim=1)
    mask = doc[:, :, None] == doc[:, None, :]  # the one (batch, seq, seq) tensor: at 64k each seq x seq is 4 GiB
    return (mask.tril_() if causal else mask)[:, None]
