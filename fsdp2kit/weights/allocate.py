"""Storage for a model built on the meta device: where the shards live, ties kept, and non-persistent buffers
(e.g. rotary inv_freq) recomputed by the model's own construction code (docs/internals.md)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp2kit._internal.agree import all_ranks_or_none
from fsdp2kit._internal.dtensor import model_meshes, reshard_all
from fsdp2kit._internal.quiet import quiet_imports
from fsdp2kit._internal.scoped import divert
from fsdp2kit.blocks import tied_slots
from fsdp2kit.dist import mesh_device
from fsdp2kit.weights.hf_layout import clean_fqn, is_pretrained, original_class


def target_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Offloaded shards live in CPU memory whatever the mesh's device is.
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None and isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
                return torch.device("cpu")
    meshes = model_meshes(model)
    kind = meshes[0].device_type if meshes else ("cuda" if torch.cuda.is_available() else "cpu")
    return mesh_device(kind)


def allocate(model: nn.Module, device: torch.device) -> tuple[set[str], set[str]]:
    """Give every meta tensor storage on ``device``; returns the names of those that were meta. Weights
    shared by two modules come out of ``_apply`` as two plain tensors: they are tied again."""
    params = {n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    buffers = {n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
    if not params and not buffers:
        return params, buffers
    ties = tied_slots(model)
    reshard_all(model)

    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for (_, module, name), *others in ties:
        for _, other, other_name in others:
            other._parameters[other_name] = module._parameters[name]
    return params, buffers


def allocate_for_load(model: nn.Module, what: str = "allocating the meta-built model") -> None:
    """Storage for a meta-built model whose values all come from a checkpoint (no init is run); its
    non-persistent buffers are recomputed by its construction code, or it is an error."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    with all_ranks_or_none(model, what):
        _, buffers = allocate(model, target_device(model, None))
        fill_buffers(model, buffers, missing_ok=False)


def _to_meta(register: Callable, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if param is not None and not param.is_meta:
        param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    register(module, name, param)


def _rebuild_from_attributes(module: nn.Module) -> nn.Module:
    """A new module of the same class, from the constructor arguments it kept as same-named attributes."""
    cls = original_class(module)
    kwargs = {}
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if hasattr(module, name):
            kwargs[name] = getattr(module, name)
            if isinstance(kwargs[name], (nn.Module, torch.Tensor)):
                raise LookupError(f"{name} is a submodule or tensor: rebuilding it is not ours to guess")
        elif p.default is p.empty:
            raise LookupError(f"{name} is not kept")
    return cls(**kwargs)


def fill_buffers(model: nn.Module, names: set[str], *, missing_ok: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Copy into the buffers ``names`` the values constructing their owners gives them (transformers models
    rebuilt whole from their config, other owners from their attributes); returns them, and the names not found."""
    found: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules(remove_duplicate=False))

    def twin_buffers(prefix: str, build: Callable[[], nn.Module]) -> None:
        wanted = [n for n in names if n not in found and (not prefix or n.startswith(prefix + "."))]
        if not wanted:
            return
        try:
            # Built for real on CPU, but each parameter moves to meta as it is registered (cheap even
            # for a very large model), drawing from a fork of the random state.
            with (
                torch.random.fork_rng(devices=[]),
                torch.device("cpu"),
                divert(nn.Module, "register_parameter", _to_meta),
                quiet_imports(),
            ):
                twin = build()
        except Exception:
            return
        values = {clean_fqn(n): b for n, b in twin.named_buffers(remove_duplicate=False)}
        cut = len(clean_fqn(prefix)) + 1 if prefix else 0
        for n in wanted:
            twin_value = values.get(clean_fqn(n)[cut:])
            if twin_value is not None and twin_value.shape == model.get_buffer(n).shape and not twin_value.is_meta:
                found[n] = twin_value

    # Outermost transformers models first: one construction from the config covers everything (an
    # inner one is built only for what the outer one left out).
    for prefix, module in modules.items():
        if is_pretrained(module) and getattr(module, "config", None) is not None:
            twin_buffers(prefix, lambda module=module: original_class(module)(copy.deepcopy(module.config)))

    # Whatever is left: the owning module, rebuilt from its attributes.
    for owner in dict.fromkeys(n.rpartition(".")[0] for n in sorted(names) if n not in found):
        twin_buffers(owner, lambda module=modules[owner]: _rebuild_from_attributes(module))
    copy_buffers(model, found)
    unfound = sorted(set(names) - set(found))
    if unfound and not missing_ok:
        raise ValueError(
            f"cannot recompute buffers {unfound}: their modules could not be rebuilt on CPU (not a "
            "transformers model, and constructor arguments not kept as attributes of the same name). "
            "Pass materialize(model, init_fn=...) and fill them there, or build those modules on a real device."
        )
    return found, unfound


def copy_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, value in values.items():
            model.get_buffer(n).copy_(value)
