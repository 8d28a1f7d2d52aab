"""Bandwidth-optimal reduce-scatter and all-gather for FSDP2 on gloo, installed through FSDP2's comm hooks.

gloo has no reduce-scatter of its own: ``ProcessGroupGloo`` clones the whole input, all-reduces
it and copies this rank's chunk out, so FSDP2 on CPU moves DDP's gradient bytes plus a copy,
and its ``all_gather_single`` is slower than point-to-point copies of the same bytes. The
collectives below move the (N-1)/N of the data that a rank must send, and no more:

- reduce-scatter: one ``all_to_all_single`` hands every rank the N contributions to its own
  chunk, which it then sums in rank order (and divides by N for ``AVG``);
- all-gather: every rank sends its shard to every other rank and receives theirs straight into
  the output buffer (FSDP2 already places the rank's own shard there).

`install_collectives` puts them on every FSDP unit of a model whose mesh is on CPU over gloo;
`shard_model` calls it, so users get them without asking. NCCL (and any other backend) keeps
FSDP2's own collectives. See docs/gloo-collectives.md for the measurements and the fallbacks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

# FSDP2's comm-hook interface (set_custom_reduce_scatter / set_custom_all_gather) is defined
# only in this private module in torch 2.13; the classes are what the public methods take.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = [
    "COLLECTIVES",
    "GlooAllGather",
    "GlooReduceScatter",
    "install_collectives",
    "resolve_collectives",
    "uses_gloo",
]

COLLECTIVES = ("auto", "torch")
"""``shard_model(collectives=...)``: "auto" = fsdp2kit's on gloo, FSDP2's elsewhere; "torch" = FSDP2's own."""

# gloo matches point-to-point messages by (peer, tag); a tag of our own keeps these apart from a
# user's own send/recv on the same group (collectives use a separate slot space).
_P2P_TAG = 0x5F2D


class _Works(dist.Work):
    """One `dist.Work` over several, as FSDP2 expects a single handle from an async all-gather."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True


class _PlainAlloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class GlooReduceScatter(_PlainAlloc, ReduceScatter):
    """Reduce-scatter as an all-to-all of the N chunks, then a local sum in rank order.

    Each rank sends N-1 chunks and receives N-1 (a reduce-scatter's minimum), against gloo's
    built-in path that all-reduces the whole input. ``SUM`` and ``AVG`` (FSDP2's op for fp32 and
    bf16 gradients; the sum divided by N, as gloo computes it) are handled here; other ops
    (``PREMUL_SUM`` from a custom gradient divide factor) and ``async_op=True`` (FSDP2 does not
    ask for it) go to gloo's own ``dist.reduce_scatter_single`` unchanged. At two ranks the
    result is bitwise gloo's; at more, the sum's order differs from gloo's ring (float32: ~1
    ulp). A bf16 reduction is summed with float32 accumulation, rounded once.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        n = group.size()
        if async_op or n == 1 or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        received = torch.empty_like(input_tensor)  # gloo's own path clones the input: same peak
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(n, -1), dim=0, out=output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)
        return None


class GlooAllGather(_PlainAlloc, AllGather):
    """All-gather as point-to-point sends of this rank's shard to every other rank, received in
    place into the output; bitwise the same bytes as ``all_gather_single``, with no extra
    buffer.

    Asynchronous even when FSDP2 asks for a blocking call (``always_async``, the default): FSDP2
    waits on the returned `dist.Work` in its copy-out, right before the bytes are read. On CPU,
    where FSDP2 has no streams, a blocking all-gather stops the rank until its peers arrive, so a
    prefetched all-gather would not overlap the compute of the unit before it; asynchronous, it
    does, and a rank that runs ahead no longer waits at every unit for one that lags (the ranks
    share cores here). ``always_async=False`` honours ``async_op`` as given (fsdp2kit's behaviour
    before; the benchmark's reference).
    """

    def __init__(self, *, always_async: bool = True):
        super().__init__()
        self.always_async = always_async

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        n, me = group.size(), group.rank()
        chunks = output_tensor.view(n, -1)
        works = []
        for peer in range(n):
            if peer != me:
                works.append(dist.isend(input_tensor, group=group, group_dst=peer, tag=_P2P_TAG))
                works.append(dist.irecv(chunks[peer], group=group, group_src=peer, tag=_P2P_TAG))
        own = chunks[me]
        if own.data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its input into place already
            own.copy_(input_tensor.view(-1))
        if async_op or self.always_async:
            return _Works(works)
        for work in works:
            work.wait()
        return None


def uses_gloo(mesh: DeviceMesh) -> bool:
    """Whether every dimension of ``mesh`` runs its CPU collectives on gloo."""
    if mesh.device_type != "cpu":
        return False
    for dim in range(mesh.ndim):
        backend = str(dist.get_backend(mesh.get_group(dim))).lower()
        if backend != "gloo" and "cpu:gloo" not in backend:
            return False
    return True


def resolve_collectives(collectives: str) -> str:
    """``collectives`` checked against `COLLECTIVES` (a ValueError names the valid ones)."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives={collectives!r}: expected one of {list(COLLECTIVES)}")
    return collectives


def install_collectives(model: nn.Module, mesh: DeviceMesh, collectives: str = "auto") -> int:
    """Give every FSDP unit of ``model`` fsdp2kit's gloo collectives; return how many got them.

    Does nothing (returns 0) with ``collectives="torch"`` or when ``mesh`` is not a CPU mesh on
    gloo. A unit whose parameters live on several meshes (FSDP2's per-parameter
    ``shard_placement_fn`` groups) keeps FSDP2's collectives: the hook takes one comm per unit.
    HSDP's all-reduce across replicas is FSDP2's own (``dist.all_reduce``, a ring on gloo already).
    """
    if resolve_collectives(collectives) == "torch" or not uses_gloo(mesh):
        return 0
    reduce_scatter, all_gather = GlooReduceScatter(), GlooAllGather()
    installed = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            module.set_custom_reduce_scatter(reduce_scatter)
            module.set_custom_all_gather(all_gather)
        except ValueError:  # several parameter groups in one unit: FSDP2 refuses a single comm
            continue
        installed += 1
    return installed
