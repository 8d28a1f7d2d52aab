"""Process-group start-up (`init_distributed`) and device meshes (`make_mesh`)."""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DistInfo", "data_parallel_mesh", "fsdp_mesh_shape", "init_distributed", "make_mesh", "mesh_device"]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def mesh_device(device_type: str) -> torch.device:
    """The device this rank computes on for a mesh of ``device_type`` (its own GPU on CUDA)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def init_distributed(*, timeout: timedelta | float = timedelta(minutes=10), device: str | None = None) -> DistInfo:
    """Start (or join) the default process group from torchrun's environment; safe to call twice.

    Without torchrun's variables the process is a world of one. NCCL on CUDA (with gloo beside it for CPU
    tensors), gloo on CPU; ``device="cpu"`` forces the CPU path. On CUDA each rank's device is set from
    LOCAL_RANK before the group starts. ``timeout`` (seconds or a timedelta) bounds every collective.
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    dev_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch.cuda.is_available() is False")

    try:
        local_rank = int(os.environ.get("LOCAL_RANK") or 0)  # torchrun sets it
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={os.environ['LOCAL_RANK']!r} is not an integer") from None
    dev = torch.device("cuda", local_rank) if dev_type == "cuda" else torch.device("cpu")
    if dev_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPU(s): "
                "launch at most one process per GPU (torchrun --nproc_per_node)"
            )
        torch.cuda.set_device(local_rank)

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if dev_type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            group = dict(device_id=dev if dev_type == "cuda" else None, **_elastic_store(timeout))
        else:  # plain `python script.py`: a world of one needs no rendezvous at all
            group = dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend=backend, timeout=timeout, **group)
        atexit.unregister(_settle_gloo_workers)  # once per process, however many groups come and go
        atexit.register(_settle_gloo_workers)

    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, str(dist.get_backend()))


def _settle_gloo_workers(seconds: float = 0.05) -> None:
    """Give gloo's worker threads a moment without the GIL before the interpreter finalizes: one freeing a
    collective's tensors during finalization aborts the process (docs/gloo-exit.md)."""
    time.sleep(seconds)


def _elastic_store(timeout: timedelta) -> dict:
    """Under torchrun with restarts: a store whose keys are private to this attempt, so a restarted rank never
    reads a dead attempt's peer address (pytorch/pytorch#167288; docs/gloo-exit.md)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return {}  # not torchelastic: env:// as usual
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts_store,
    )
    return {"store": dist.PrefixStore(f"fsdp2kit/attempt_{attempt}", store), "rank": rank, "world_size": world}


def _fits(world: int, cp: int = 1) -> str:
    """Every (shard, replicate, tp) that fits a world (with ``cp`` given), for an error message."""
    if cp < 1 or world % cp:
        return f"none with cp={cp} (cp must divide the world size)"
    n = world // cp
    return ", ".join(
        f"(shard={n // t // r}, replicate={r}" + (f", cp={cp}" if cp > 1 else "") + (f", tp={t})" if t > 1 else ")")
        for t in range(1, n + 1)
        if n % t == 0
        for r in range(1, n // t + 1)
        if (n // t) % r == 0
    )


def make_mesh(
    shard: int = -1, replicate: int = 1, tp: int = 1, *, cp: int = 1, device_type: str | None = None
) -> DeviceMesh:
    """A DeviceMesh over every rank of the default group, dimensions ``("replicate", "shard", "cp", "tp")``, each one
    present when above 1 (``"shard"`` always; README.md's Meshes, docs/long-sequences.md's The mesh). One of
    ``shard`` and ``replicate`` may be -1 (whatever the world size leaves); sizes that do not fit are a
    ``ValueError`` listing those that would.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs a process group: call fsdp2kit.init_distributed() first")
    world = dist.get_world_size()
    dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")

    for name, value in (("shard", shard), ("replicate", replicate), ("tp", tp), ("cp", cp)):
        allowed_infer = name not in ("tp", "cp")
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and not (allowed_infer and value == -1)):
            what = "a positive int or -1 (infer)" if allowed_infer else "a positive int"
            raise ValueError(f"make_mesh: {name}={value!r} must be {what}")
    if shard == -1 and replicate == -1:
        raise ValueError(
            f"make_mesh: at most one of shard and replicate may be -1; for world size {world}: {_fits(world, cp)}"
        )
    extra = "".join(f", {n}={v}" for n, v in (("cp", cp), ("tp", tp)) if v != 1)
    given = f"shard={shard}, replicate={replicate}{extra}"
    dp = world // (tp * cp) if world % (tp * cp) == 0 else 0
    if shard == -1:
        shard = dp // replicate if dp else 0
    elif replicate == -1:
        replicate = dp // shard if dp else 0
    if shard * replicate * cp * tp != world or shard < 1 or replicate < 1:
        raise ValueError(f"make_mesh: {given} does not fit the world size {world}; sizes that work: {_fits(world, cp)}")
    sizes = {"replicate": replicate, "shard": shard, "cp": cp, "tp": tp}
    dims = {n: s for n, s in sizes.items() if s > 1 or n == "shard"}
    return init_device_mesh(dev, tuple(dims.values()), mesh_dim_names=tuple(dims))


# The name of the flattened ("shard", "cp") dimension FSDP shards over (torchtitan's dp_shard_cp).
SHARD_CP = "shard_cp"


def fsdp_mesh_shape(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The (shape, names) FSDP sees on a mesh of this shape: ``"shard"`` and ``"cp"`` folded into one
    ``"shard_cp"`` dimension of their product (the cp ranks share parameter shards); others as given."""
    cp = dict(zip(names, shape)).get("cp")
    if cp is None:
        return tuple(shape), tuple(names)
    dims = [(SHARD_CP, s * cp) if n == "shard" else (n, s) for n, s in zip(names, shape) if n != "cp"]
    return tuple(s for _, s in dims), tuple(n for n, _ in dims)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh FSDP shards over: the mesh itself, or its data-parallel dims when it has a ``"tp"`` one;
    with a ``"cp"`` dimension, ``"shard"`` and ``"cp"`` flattened into one ``"shard_cp"`` dimension."""
    names = mesh.mesh_dim_names or ()
    if "cp" in names:
        if "shard" not in names:
            raise ValueError(f"mesh {names} has a cp dimension but no 'shard' one; make it with make_mesh(cp=...)")
        # The flattened mesh is kept as _flatten returns it (slicing a flattened dim out of the root
        # mesh is deprecated); with "replicate" it is joined to that dim as a 2-D (HSDP) mesh.
        flat = mesh["shard", "cp"]._flatten(SHARD_CP)
        if "replicate" not in names:
            return flat
        return DeviceMesh._concatenate([mesh["replicate"], flat])
    if "tp" not in names:
        return mesh
    dims = tuple(n for n in names if n != "tp")
    if not dims:
        raise ValueError(
            f"mesh {names} has a tp dimension but no data-parallel one; make it with make_mesh(shard=..., tp=...), "
            "which keeps a 'shard' dimension (of size 1 when every rank is TP)"
        )
    return mesh[dims]
