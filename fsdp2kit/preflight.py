"""Checks that run before any collective, so a bad model fails with a sentence instead of a hang."""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp2kit._internal.fmt import fmt_list
from fsdp2kit._internal.markers import FROZEN_AS, SHARDED_AS, TENSOR_PARALLEL

__all__ = ["check_devices", "check_nf4_shards", "check_not_sharded", "check_optimizers_at_first_forward"]


def check_not_sharded(model: nn.Module, mesh: DeviceMesh | None = None) -> None:
    """No FSDP yet, and DTensor parameters only where `apply_tensor_parallel` put them, on ``mesh["tp"]``."""
    for name, module in model.named_modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            kind = "fully_shard (FSDP2)" if isinstance(module, FSDPModule) else "FullyShardedDataParallel (FSDP1)"
            raise ValueError(
                f"{name or type(model).__name__} is already sharded by {kind}; shard_model must be called once, "
                "on an unsharded model"
            )
    tp_info = getattr(model, TENSOR_PARALLEL, None)
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    tp = mesh["tp"].size() if "tp" in names else None
    if tp_info is None and tp is not None and tp > 1:
        raise ValueError(
            f"the mesh has a tp dimension of size {tp} but the model is not tensor-parallel: call "
            "fsdp2kit.apply_tensor_parallel(model, mesh) before shard_model, or make the mesh without tp"
        )
    if tp_info is not None and mesh is not None and tp != tp_info["tp"]:
        raise ValueError(
            f"the model is tensor-parallel over {tp_info['tp']} ranks but the mesh {names} of shape "
            f"{tuple(mesh.shape)} has no tp dimension of that size; pass the mesh given to apply_tensor_parallel"
        )
    tp_ranks = mesh["tp"].mesh.tolist() if tp is not None else None
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        if tp_info is None:
            raise ValueError(
                f"parameter {name} is already a DTensor (placements {param.placements}); shard_model expects "
                "plain tensors, or the DTensors of fsdp2kit.apply_tensor_parallel"
            )
        if mesh is not None and (
            param.device_mesh.mesh_dim_names != ("tp",) or param.device_mesh.mesh.tolist() != tp_ranks
        ):
            raise ValueError(
                f"parameter {name} is a DTensor on mesh {param.device_mesh.mesh_dim_names} ranks "
                f"{param.device_mesh.mesh.tolist()}, not on this mesh's tp dimension (ranks {tp_ranks}); pass "
                "shard_model the mesh given to apply_tensor_parallel"
            )


def check_devices(model: nn.Module, mesh: DeviceMesh, *, cpu_offload: bool) -> None:
    """All parameters on one device, of the mesh's type (meta is fine: materialize fills it later)."""
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            by_device[param.device].append(name)
    if len(by_device) > 1:
        listing = "; ".join(f"{dev}: {fmt_list(names, 1)}" for dev, names in by_device.items())
        raise ValueError(f"parameters are on different devices ({listing}); move the whole model to one device first")
    for dev, names in by_device.items():
        if dev.type != mesh.device_type and not (cpu_offload and dev.type == "cpu"):
            raise ValueError(
                f"parameters are on {dev} (e.g. {names[0]}) but the mesh is a {mesh.device_type!r} mesh; "
                f"move the model with model.to({mesh.device_type!r}), build it on the meta device, or make the mesh "
                f"with make_mesh(device_type={dev.type!r})"
            )


def check_nf4_shards(params: dict[str, nn.Parameter], shard: int) -> None:
    """NF4 weights split into whole quantization groups, evenly (FSDP would pad, NF4 cannot hold padding)."""
    from fsdp2kit.weights.nf4 import is_nf4, nf4_shard_problem

    nf4 = {n: p for n, p in params.items() if is_nf4(p)}
    if nf4 and shard == 1:
        # FSDP2 skips the all-gather of a one-rank shard group and hands an all-gather extension
        # only its first input (FSDPParamGroup.wait_for_unshard, torch 2.13); NF4 has three.
        raise ValueError(
            f"NF4 weights ({fmt_list(sorted(nf4), 2)}) need a shard group of 2 or more ranks: with one rank "
            "per shard group (NO_SHARD, or HSDP with shard=1) FSDP2 skips the all-gather that unpacks NF4 shards"
        )
    bad = [f"{n} {tuple(p.shape)}: {why}" for n, p in nf4.items() if (why := nf4_shard_problem(p, shard))]
    if bad:
        raise ValueError(
            f"NF4 weights cannot be sharded {shard} ways: {fmt_list(bad, 4)}. Use a shard size that divides these "
            "rows into whole quantization groups, or quantize_nf4 with a smaller block_size / scaler_block_size"
        )


def _refuse_replaced_params(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            frozen = getattr(param, FROZEN_AS, None)
            if frozen is not None and not param.requires_grad:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the frozen parameter {frozen!r} (requires_grad=False): with a "
                    "frozen base (LoRA, QLoRA) build the optimizer from the trainable parameters only, "
                    "[p for p in model.parameters() if p.requires_grad], so that no state is kept or checkpointed "
                    "for the base"
                )
            name = getattr(param, SHARDED_AS, None)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {name!r} as it was before shard_model replaced it; "
                    "stepping it would not change the model. Build the optimizer after shard_model, from "
                    "model.parameters()."
                )


def check_optimizers_at_first_forward(model: nn.Module, replaced: Iterable[nn.Parameter]) -> None:
    """At ``model``'s first forward, give each optimizer holding a parameter ``shard_model`` replaced, or a frozen
    sharded one, a step pre-hook that raises; nothing global is installed. Call it after sharding."""
    for name, param in model.named_parameters():
        if not param.requires_grad:
            setattr(param, FROZEN_AS, name)
    watched = [weakref.ref(p) for p in replaced]

    def first_forward(module: nn.Module, args: tuple) -> None:
        handle.remove()
        if not any(r() is not None for r in watched) and not any(
            getattr(p, FROZEN_AS, None) is not None for p in module.parameters()
        ):
            return
        # Every optimizer in the process, from the garbage collector's objects (~0.1 s at 300k); type(o), not
        # isinstance: an object's own __class__ may raise (a dead weakref.proxy).
        for optimizer in [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]:
            try:
                _refuse_replaced_params(optimizer, (), {})
            except RuntimeError:
                optimizer.register_step_pre_hook(_refuse_replaced_params)

    handle = model.register_forward_pre_hook(first_forward)
