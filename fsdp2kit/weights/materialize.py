"""`materialize`: a meta-built, sharded model gets storage and the values its own initialisation gives it."""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode, handle_torch_function
from torch.utils._pytree import tree_map_only

from fsdp2kit._internal.agree import all_ranks_or_none
from fsdp2kit._internal.dtensor import local_index, local_shard, model_meshes
from fsdp2kit._internal.scoped import divert
from fsdp2kit.dist import mesh_device
from fsdp2kit.weights.allocate import allocate, copy_buffers, fill_buffers, target_device
from fsdp2kit.weights.hf_layout import is_pretrained
from fsdp2kit.weights.nf4 import is_nf4

# torch.nn.init functions that do not hand a sharded tensor to the mode themselves (uniform_, normal_,
# constant_, kaiming_uniform_ do): run whole on the stand-in, as one in-place call.
_UNDISPATCHED = (
    "trunc_normal_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_normal_",
    "orthogonal_", "sparse_",
)  # fmt: skip


def _dispatch(original: Callable, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return handle_torch_function(original, (tensor,), tensor, *args, **kwargs)
    return original(tensor, *args, **kwargs)


class _Replay(TorchFunctionMode):
    """Runs init calls on full-size plain stand-ins of sharded parameters (a module's own, and any other
    whole one an in-place op writes), the same on every rank; each keeps its rows (docs/internals.md)."""

    def __init__(self, model: nn.Module, device: torch.device, write: set[str]):
        super().__init__()
        self.device = device
        self.stand_ins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id: (parameter, full)
        params = list(model.named_parameters(remove_duplicate=False))
        self.names = {id(p): name for name, p in reversed(params)}  # a tied weight's first name
        self.owners = Counter(id(p) for _, p in params)
        self.write = {id(p) for name, p in params if name in write}
        self.done: set[int] = set()
        self.current = "(none)"

    def _blank(self, p: torch.Tensor) -> torch.Tensor:
        t = torch.empty(p.shape, dtype=p.dtype, device=self.device)
        # NaN marks "not written": an init that leaves any of it is found out below.
        return t.fill_(math.nan) if (t.is_floating_point() or t.is_complex()) else t.zero_()

    def _commit(self, p: torch.Tensor, full: torch.Tensor, *, through_owner: bool) -> None:
        pid = id(p)
        name = self.names[pid]
        if through_owner and pid in self.done and self.owners[pid] > 1:
            # A tied weight is initialised by its first owner; a later owner's init ran on a
            # scratch tensor so that the random stream matches the untied model's.
            return
        if tuple(full.shape) != tuple(p.shape):
            raise RuntimeError(f"{self.current}'s initialisation replaced {name} with shape {tuple(full.shape)}")
        if full.numel() and (full.is_floating_point() or full.is_complex()):
            unset = torch.isnan(full)
            if unset.all():
                return  # this call did not touch it
            if unset.any():
                raise RuntimeError(f"{self.current}'s initialisation wrote only part of {name}")
        if pid in self.write:
            with torch.no_grad():
                local_shard(p).copy_(full[local_index(p)])
        self.done.add(pid)

    def call(self, module: nn.Module, label: str, fn: Callable[[], object]) -> None:
        self.current, self.stand_ins = label, {}
        saved = {n: p for n, p in module._parameters.items() if p is not None}
        for n, p in saved.items():
            module._parameters[n] = nn.Parameter(self._blank(p), requires_grad=p.requires_grad)
        try:
            fn()
        finally:
            result = {n: module._parameters[n] for n in saved}
            module._parameters.update(saved)
        for p, full in self.stand_ins.values():  # other modules' parameters, as the call left them
            self._commit(p, full, through_owner=False)
        for n, p in saved.items():
            self._commit(p, result[n].detach(), through_owner=True)

    def _refused(self, op: str, how: str) -> RuntimeError:
        return RuntimeError(
            f"{self.current}'s initialisation calls {op} on a sharded parameter {how}; materialize replays writes "
            "of whole parameters only. Use torch.nn.init.* on the parameter itself, or pass "
            "materialize(model, init_fn=...)."
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        # The written tensor: an in-place op's first (torch.nn.init passes it by keyword), or out=.
        target = kwargs.get("out") if "out" in kwargs else (args[0] if args else kwargs.get("tensor"))
        new = False
        if isinstance(target, DTensor) and (in_place or "out" in kwargs):
            if id(target) not in self.names:
                raise self._refused(name, "through a slice or copy (e.g. .data)")
            new = id(target) not in self.stand_ins
            if new:
                self.stand_ins[id(target)] = (target, self._blank(target))
        elif (
            id(target) in self.names
            and id(target) not in self.stand_ins
            and (name.startswith("new_") or name.endswith("_like"))
        ):
            # reads only its shape (orthogonal_'s new_empty, trunc_normal_'s empty_like): a plain tensor's result
            return func(torch.empty(target.shape, dtype=target.dtype, device=self.device), *args[1:], **kwargs)
        if not self.stand_ins:
            return func(*args, **kwargs)
        # Every use of a parameter this call writes reads its stand-in, so an init built of several ops
        # (trunc_normal_'s redraws, eye_'s out=, reached not through torch.nn.init) runs whole on the full tensor.
        args, kwargs = tree_map_only(DTensor, lambda t: self.stand_ins.get(id(t), (t, t))[1], (args, kwargs))
        result = func(*args, **kwargs)
        if new:
            full = self.stand_ins[id(target)][1]
            if full.is_floating_point() and full.numel() and torch.isnan(full).all():  # it read the value (mul_...)
                raise self._refused(name, "it has not written in the same call")
        owner = next((p for p, full in self.stand_ins.values() if full is result), None)
        return result if owner is None else owner


def _init_calls(model: nn.Module) -> Iterator[tuple[nn.Module, str, Callable[[], object]]]:
    """Per-module init calls: the nearest PreTrainedModel's ``_init_weights``, else ``reset_parameters``."""

    def visit(prefix: str, module: nn.Module, owner: nn.Module | None) -> Iterator:
        label = prefix or "(root)"
        if owner is None and callable(getattr(module, "reset_parameters", None)):
            yield module, label, module.reset_parameters
        for name, child in module.named_children():
            child_owner = child if is_pretrained(child) else owner
            yield from visit(f"{prefix}.{name}" if prefix else name, child, child_owner)
        if owner is not None:
            yield module, label, functools.partial(owner._init_weights, module)

    yield from visit("", model, model if is_pretrained(model) else None)


@contextlib.contextmanager
def _rank0_rng(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside, every rank draws from a copy of the mesh's first rank's random state; on exit its own is back."""
    meshes = model_meshes(model) if dist.is_initialized() else []
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if device.type == "cuda":
        states.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        for get, put in states if meshes else ():  # without a mesh, this rank's own state
            state = get().to(mesh_device(meshes[0].device_type))
            for d in range(meshes[0].ndim):
                dist.broadcast(state, group=meshes[0].get_group(d), group_src=0)
            put(state.cpu())
        yield


def materialize(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give a model built on the meta device (and usually sharded) real storage and initial values.

    Call it after `fsdp2kit.shard_model`, on every rank of the mesh (it is collective); only
    tensors still on the meta device are touched. Parameters get the model's own init
    (transformers' ``_init_weights``, else ``reset_parameters``), or ``init_fn(module)`` for every
    module: bit for bit that init on an unsharded copy, at any world size, and each rank keeps its
    own random state (docs/internals.md). A tied weight takes its first owner's init; a parameter
    no init writes is a ``ValueError`` naming it. Buffers get the values an ordinary CPU
    construction gives them; those it cannot recompute must be filled by ``init_fn``, or it raises.

    Args:
        model: built under ``torch.device("meta")``, after `shard_model` (or unsharded).
        device: where the shards live; default: the mesh's device (CPU for ``cpu_offload``).
        init_fn: replaces the model's initialisation; called once per module with that module's
            direct parameters as full, unsharded tensors.
    """
    nf4 = [n for n, p in model.named_parameters() if p.is_meta and is_nf4(p)]
    if nf4:
        raise ValueError(
            f"materialize cannot initialise NF4 weights ({nf4[0]} and {len(nf4) - 1} more): a quantized base "
            "comes from a checkpoint; call load_pretrained(model, hf_dir), which quantizes each rank's rows"
        )
    device = target_device(model, device)
    with all_ranks_or_none(model, "materialize"):
        params, buffers = allocate(model, device)
    if not params and not buffers:
        return model
    with _rank0_rng(model, device), all_ranks_or_none(model, "materialize"):
        # Buffers before the init (init code may read them) and again after (it may write them):
        # what stays is the construction's value.
        values, unfound = fill_buffers(model, buffers, missing_ok=init_fn is not None)
        with torch.no_grad():
            for name in unfound:  # init_fn must fill these: NaN shows if it did not
                if model.get_buffer(name).is_floating_point():
                    model.get_buffer(name).fill_(math.nan)
            replay = _Replay(model, device, params)
            with replay, contextlib.ExitStack() as diverted:
                for name in _UNDISPATCHED:  # this thread, this call only (fsdp2kit._internal.scoped)
                    diverted.enter_context(divert(torch.nn.init, name, _dispatch))
                if init_fn is None:
                    calls = _init_calls(model)
                else:
                    calls = ((m, n or "(root)", functools.partial(init_fn, m)) for n, m in model.named_modules())
                for module, label, fn in calls:
                    replay.call(module, label, fn)
            copy_buffers(model, values)
        if undone := sorted(replay.names[pid] for pid in replay.write if pid not in replay.done):
            own = init_fn is not None
            how = "init_fn" if own else "the model's initialisation (_init_weights / reset_parameters)"
            fix = "Initialise them in init_fn" if own else "Pass materialize(model, init_fn=...) that sets them"
            raise ValueError(f"{how} left {len(undone)} parameter(s) unset: {undone[:20]}. {fix}.")
        if unset := [n for n in unfound if torch.isnan(model.get_buffer(n)).any()]:  # False for integer buffers
            raise ValueError(f"init_fn left buffers {unset} unset (the model's construction cannot recompute them)")
    return model
