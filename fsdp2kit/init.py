"""Filling a sharded model: initialisation from the meta device, and pretrained Hugging Face weights.

A model built under ``torch.device("meta")`` costs no memory, and `shard_model` can shard it as
it is; what it lacks is values. `materialize` gives every rank storage for its shards and the
values the model's own initialisation would give; `load_pretrained` instead reads a Hugging Face
safetensors checkpoint straight into the shards, each rank reading only the rows it owns.

Buffers are the trap of meta-device initialisation. Parameters get initialised by an init
function, but buffers (rotary ``inv_freq``, Gemma's ``embed_scale``, attention masks) are computed
in ``__init__`` and nothing recomputes them: after ``to_empty`` they hold whatever was in memory,
and a model with a garbage ``inv_freq`` still trains, only worse. We take every buffer from a
construction of its owner on CPU whose parameters are put on the meta device as they are
registered, so the buffers come out of the model's own code and the parameters cost nothing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from fsdp2kit._hf import clean_fqn, is_pretrained, original_class, plan_load
from fsdp2kit.plan import fmt_list

__all__ = ["LoadResult", "load_pretrained", "materialize"]


# ----------------------------------------------------------------------------------------------
# Shards: which part of the full tensor this rank holds


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (a view into FSDP's padded storage)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _local_index(t: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's shard in the full tensor, read from the DTensor's placements."""
    if not isinstance(t, DTensor):
        return tuple(slice(None) for _ in t.shape)
    for p in t.placements:
        if type(p) not in (Shard, Replicate):
            raise NotImplementedError(
                f"fsdp2kit reads and writes shards placed as Shard or Replicate; got {t.placements} "
                "(tensor-parallel layouts such as _StridedShard are not supported here)"
            )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _meshes(model: nn.Module) -> list:
    found = []
    for p in model.parameters():
        if isinstance(p, DTensor) and all(p.device_mesh is not m for m in found):
            found.append(p.device_mesh)
    return found


def _agree_failed(failed: bool, model: nn.Module) -> bool:
    """Whether any rank of the model's mesh failed: a local error becomes every rank's error."""
    meshes = _meshes(model)
    if not meshes or not dist.is_initialized():
        return failed
    mesh = meshes[0]
    flag = torch.tensor([1 if failed else 0], device=mesh.device_type)
    for d in range(mesh.ndim):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
    return bool(flag.item())


@contextlib.contextmanager
def _all_ranks_or_none(model: nn.Module, what: str) -> Iterator[None]:
    """Run a local phase so that it fails on every rank or on none: no rank runs on into a hang."""
    try:
        yield
    except BaseException:
        _agree_failed(True, model)
        raise
    if _agree_failed(False, model):
        raise RuntimeError(f"{what} failed on another rank (see that rank's error); nothing is usable here")


def _reshard(model: nn.Module) -> None:
    """Make sure the sharded parameters are the registered ones (after a forward, they may not be)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ----------------------------------------------------------------------------------------------
# Storage


def _target_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Offloaded shards live in CPU memory whatever the mesh's device is.
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None and isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
                return torch.device("cpu")
    meshes = _meshes(model)
    kind = meshes[0].device_type if meshes else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _tied_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    slots: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots[id(p)].append((module, name))
    return [s for s in slots.values() if len(s) > 1]


def _allocate(model: nn.Module, device: torch.device) -> tuple[set[str], set[str]]:
    """Give every meta tensor storage on ``device``; returns the names of those that were meta.

    ``to_empty`` replaces each module's tensors one module at a time, so a weight shared by two
    modules would come out as two tensors: we re-tie them (DTensor parameters keep their object,
    plain ones do not). FSDP2 re-pads its sharded storage inside ``to_empty`` itself.
    """
    params = {n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    buffers = {n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
    if not params and not buffers:
        return params, buffers
    ties = _tied_slots(model)
    _reshard(model)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device=device) if t.is_meta else t

    model._apply(fn)
    for slots in ties:
        module, name = slots[0]
        shared = module._parameters[name]
        for other, other_name in slots[1:]:
            other._parameters[other_name] = shared
    return params, buffers


# ----------------------------------------------------------------------------------------------
# Buffers: from a construction with parameters on the meta device


@contextlib.contextmanager
def _parameters_on_meta(dtype: torch.dtype | None) -> Iterator[None]:
    """Build modules for real on CPU, except that each parameter moves to meta as it is registered.

    The constructor's own code computes the buffers; ``torch.empty`` for a parameter reserves
    address space without touching it, and the meta copy costs nothing, so this is cheap even
    for a very large model.
    """
    register = nn.Module.register_parameter

    def to_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    previous = torch.get_default_dtype()
    rng = torch.get_rng_state()  # a constructor may draw (nn.Parameter(torch.randn(...))): not from ours
    nn.Module.register_parameter = to_meta
    try:
        if dtype is not None and dtype.is_floating_point:
            torch.set_default_dtype(dtype)
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register
        torch.set_default_dtype(previous)
        torch.set_rng_state(rng)


def _rebuild_from_attributes(module: nn.Module) -> nn.Module | None:
    """A new module of the same class, built from the arguments it kept as attributes of the same name.

    Most modules that own a computed buffer store their constructor's arguments (``dim``,
    ``base``, ``max_seq_len``, ``config``...); when every required argument is found this way we
    can run the class's own ``__init__`` again. Returns None when it cannot.
    """
    cls = original_class(module)
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in module.__dict__ or hasattr(module, name):
            value = getattr(module, name)
            if isinstance(value, (nn.Module, torch.Tensor)):
                return None  # a submodule or tensor argument: rebuilding it is not ours to guess
            kwargs[name] = value
        elif p.default is p.empty:
            return None
    try:
        return cls(**kwargs)
    except Exception:
        return None


def _param_dtype(model: nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _construction_buffers(model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    """CPU values for the buffers ``names`` (raw names) as constructing their owners gives them.

    Hugging Face models are rebuilt whole from their config (one call covers every buffer of
    every submodule, whatever it is called); any other module that owns one of the buffers is
    rebuilt from its own attributes. Buffers found neither way are left out.
    """
    if not names:
        return {}
    dtype = _param_dtype(model)
    found: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules(remove_duplicate=False))

    def twin_buffers(prefix: str, build: Callable[[], nn.Module]) -> None:
        wanted = [n for n in names if n not in found and (not prefix or n.startswith(prefix + "."))]
        if not wanted:
            return
        try:
            with _parameters_on_meta(dtype):
                twin = build()
        except Exception:
            return
        values = {clean_fqn(n): b for n, b in twin.named_buffers(remove_duplicate=False)}
        cut = len(clean_fqn(prefix)) + 1 if prefix else 0
        for n in wanted:
            twin_value = values.get(clean_fqn(n)[cut:])
            target = model.get_buffer(n)
            if twin_value is not None and twin_value.shape == target.shape and not twin_value.is_meta:
                found[n] = twin_value

    # Outermost transformers models first: one construction from the config covers everything.
    claimed: list[str] = []
    for prefix, module in modules.items():
        if any(c == "" or prefix == c or prefix.startswith(c + ".") for c in claimed):
            continue
        if is_pretrained(module) and getattr(module, "config", None) is not None:
            claimed.append(prefix)
            cls = original_class(module)
            twin_buffers(prefix, lambda cls=cls, module=module: cls(copy.deepcopy(module.config)))

    # Whatever is left: the owning module, rebuilt from its attributes.
    owners = defaultdict(list)
    for n in names:
        if n not in found:
            owners[n.rpartition(".")[0]].append(n)
    for owner in owners:
        module = modules[owner]
        twin_buffers(owner, lambda module=module: _rebuild_from_attributes(module) or _fail())
    return found


def _fail() -> nn.Module:
    raise LookupError


def _fill_buffers(model: nn.Module, names: set[str], *, missing_ok: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Copy construction values into the buffers ``names``; returns them, and the names not found."""
    values = _construction_buffers(model, names)
    _copy_buffers(model, values)
    unfound = sorted(set(names) - set(values))
    if unfound and not missing_ok:
        raise ValueError(
            f"cannot recompute buffers {unfound}: their modules could not be rebuilt on CPU (not a "
            "transformers model, and constructor arguments not kept as attributes of the same name). "
            "Pass materialize(model, init_fn=...) and fill them there, or build those modules on a real device."
        )
    return values, unfound


def _copy_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, value in values.items():
            model.get_buffer(n).copy_(value)


# ----------------------------------------------------------------------------------------------
# Parameters: the model's own initialisation, replayed one full tensor at a time

_INIT_FUNCTIONS = (
    "uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
# Modules that bind torch.nn.init functions by name at import (transformers patches the same list).
_TORCH_INIT_MODULES = (
    "torch.nn.init", "torch.nn.modules.activation", "torch.nn.modules.transformer", "torch.nn.modules.linear",
    "torch.nn.modules.loss", "torch.nn.modules.batchnorm", "torch.nn.modules.conv",
    "torch.nn.modules.normalization", "torch.nn.modules.rnn", "torch.nn.modules.sparse",
)  # fmt: skip


class _NoShardWrites(TorchFunctionMode):
    """Turns an in-place write to a sharded parameter that bypassed the replay into an error.

    Init code that reaches a DTensor parameter through anything but a ``torch.nn.init`` function
    (``child.weight.data.normal_()``, ``weight[0].zero_()``) would write each rank's shard with
    the same random numbers, or write a temporary copy: never silently.
    """

    def __init__(self, replay: _Replay):
        super().__init__()
        self.replay = replay

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if (
            args
            and isinstance(args[0], DTensor)
            and (name == "__setitem__" or (name.endswith("_") and not name.startswith("_")))
        ):
            raise RuntimeError(
                f"{self.replay.current}'s initialisation calls {name} on a sharded parameter directly; "
                "materialize replays initialisation through torch.nn.init functions (or on the module's own "
                "parameters). Use torch.nn.init.* there, or pass materialize(model, init_fn=...)."
            )
        return func(*args, **(kwargs or {}))


class _Replay:
    """Runs init calls with full-size plain tensors in place of a module's sharded parameters.

    Every rank builds each full tensor, runs the init code on it with the same random state,
    and keeps its own rows: so the sharded model holds exactly what the same init gives an
    unsharded model, at any world size, and no rank ever holds more than the parameters of the
    one module being initialised.
    """

    def __init__(self, model: nn.Module, device: torch.device, write: set[str]):
        self.device = device
        self.names: dict[int, str] = {}
        self.owners: Counter = Counter()
        self.write: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), name)
            self.owners[id(p)] += 1
            if name in write:
                self.write.add(id(p))
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
                _local(p).copy_(full[_local_index(p)])
        self.done.add(pid)

    def call(self, module: nn.Module, label: str, fn: Callable[[], object]) -> None:
        self.current = label
        saved = {n: p for n, p in module._parameters.items() if p is not None}
        for n, p in saved.items():
            module._parameters[n] = nn.Parameter(self._blank(p), requires_grad=p.requires_grad)
        try:
            fn()
        finally:
            result = {n: module._parameters[n] for n in saved}
            for n, p in saved.items():
                module._parameters[n] = p
        for n, p in saved.items():
            self._commit(p, result[n].detach(), through_owner=True)

    def init_function(self, original: Callable, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """A torch.nn.init function called on a sharded parameter of another module."""
        if id(tensor) not in self.names:
            raise RuntimeError(
                f"{self.current}'s initialisation calls torch.nn.init.{original.__name__} on a slice or copy of "
                "a sharded parameter; only whole parameters can be initialised after sharding"
            )
        full = self._blank(tensor)
        original(full, *args, **kwargs)
        self._commit(tensor, full, through_owner=False)
        return tensor

    def undone(self) -> list[str]:
        return sorted(self.names[pid] for pid in self.write if pid not in self.done)


@contextlib.contextmanager
def _route_init_functions(replay: _Replay) -> Iterator[None]:
    """torch.nn.init.* (and transformers' wrappers over them) route sharded parameters to ``replay``."""
    patched: list[tuple[object, str, object]] = []

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def routed(tensor, *args, **kwargs):
            if isinstance(tensor, DTensor):
                return replay.init_function(original, tensor, *args, **kwargs)
            return original(tensor, *args, **kwargs)

        routed._fsdp2kit_original = original  # type: ignore[attr-defined]
        return routed

    originals = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for mod_name in _TORCH_INIT_MODULES:
            mod = sys.modules.get(mod_name)
            for name in _INIT_FUNCTIONS:
                if mod is not None and getattr(mod, name, None) is originals[name]:
                    patched.append((mod, name, originals[name]))
                    setattr(mod, name, wrap(originals[name]))
        hf_init = sys.modules.get("transformers.initialization")
        table = getattr(hf_init, "TORCH_INIT_FUNCTIONS", None)
        if isinstance(table, dict):
            for name, fn in list(table.items()):
                patched.append((table, name, fn))
                table[name] = wrap(fn)
        with _NoShardWrites(replay):
            yield
    finally:
        for owner, name, fn in reversed(patched):
            if isinstance(owner, dict):
                owner[name] = fn
            else:
                setattr(owner, name, fn)


def _init_calls(model: nn.Module) -> Iterator[tuple[nn.Module, str, Callable[[], object]]]:
    """The model's own initialisation as a sequence of per-module calls, in the model's order.

    transformers models: ``owner._init_weights(module)`` children first, each module dispatched
    to its nearest enclosing PreTrainedModel (what ``PreTrainedModel.initialize_weights`` does).
    Other modules: ``module.reset_parameters()`` in ``model.modules()`` order, as construction
    runs them.
    """

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


def _sync_rng(model: nn.Module, device: torch.device) -> None:
    """Every rank takes the random state of the mesh's first rank, so that full tensors agree."""
    meshes = _meshes(model)
    if not meshes or not dist.is_initialized():
        return
    mesh = meshes[0]
    comm = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    getters = [(torch.get_rng_state, torch.set_rng_state)]
    if device.type == "cuda":
        getters.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    for get, put in getters:
        state = get().to(comm)
        for d in range(mesh.ndim):
            dist.broadcast(state, group=mesh.get_group(d), group_src=0)
        put(state.cpu())


def materialize(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give a model built on the meta device (and usually sharded) real storage and initial values.

    Call it after `fsdp2kit.shard_model`, on every rank of the mesh (it is collective). Only
    tensors still on the meta device are touched: calling it on a materialised model does nothing.

    Parameters are initialised by the model's own code: transformers models by their
    ``_init_weights`` (in the order ``initialize_weights`` uses), other modules by their
    ``reset_parameters``, or by ``init_fn(module)`` for every module in ``model.modules()``
    order if you pass one. That code runs on full-size, unsharded plain tensors standing in for
    the module's own parameters, one module at a time, on every rank from the random state of
    the mesh's first rank (every rank leaves with that state); each rank keeps its own rows.
    So ``init_fn`` is written as for an unsharded model, and what you get is guaranteed to be:

    - the same, bit for bit, as running the same init on an unsharded copy on the same device
      from the same random state, at every world size and mesh shape (the sharded and a
      single-process model agree exactly);
    - drawn from the model's own distributions (same std, same zeroed padding row...);
    - not in general equal to an ordinary construction with the same seed: constructing a
      transformers model on CPU first draws torch's default init for every layer and then
      overwrites it, so its random stream differs from a replay of ``_init_weights`` alone. For
      models whose construction is only their modules' ``reset_parameters`` (plain torch
      layers) the two agree.

    A weight tied between modules stays one tensor and takes the value of its first owner's init.
    A parameter that no init writes raises a ``ValueError`` naming it (pass ``init_fn``).

    Every buffer that was on the meta device gets exactly the value an ordinary CPU construction
    gives it (cast to the buffer's dtype): transformers models are rebuilt from their config
    with parameters on meta (cheap), other buffer owners from their constructor arguments kept
    as attributes. Buffers neither can recompute must be filled by ``init_fn``, or it raises.

    Args:
        model: built under ``torch.device("meta")``, after `shard_model` (or unsharded).
        device: where the shards live; default: the mesh's device (CPU for ``cpu_offload``).
        init_fn: replaces the model's initialisation; called once per module with that module's
            direct parameters as full, unsharded tensors.
    """
    device = _target_device(model, device)
    with _all_ranks_or_none(model, "materialize"):
        params, buffers = _allocate(model, device)
    if not params and not buffers:
        return model
    _sync_rng(model, device)
    with _all_ranks_or_none(model, "materialize"):
        # Buffers before the init (init code may read them) and again after (it may write them):
        # what stays is the construction's value.
        values, unfound = _fill_buffers(model, buffers, missing_ok=init_fn is not None)
        with torch.no_grad():
            for name in unfound:  # init_fn must fill these: NaN shows if it did not
                if model.get_buffer(name).is_floating_point():
                    model.get_buffer(name).fill_(math.nan)
            replay = _Replay(model, device, params)
            with _route_init_functions(replay):
                if init_fn is None:
                    calls = _init_calls(model)
                else:
                    calls = ((m, n or "(root)", functools.partial(init_fn, m)) for n, m in model.named_modules())
                for module, label, fn in calls:
                    replay.call(module, label, fn)
            _copy_buffers(model, values)
        undone = replay.undone()
        if undone:
            how = "init_fn" if init_fn is not None else "the model's initialisation (_init_weights / reset_parameters)"
            raise ValueError(
                f"{how} left {len(undone)} parameter(s) unset: {undone[:20]}. "
                + ("Initialise them in init_fn." if init_fn else "Pass materialize(model, init_fn=...) that sets them.")
            )
        unset = [
            n for n in unfound if model.get_buffer(n).is_floating_point() and torch.isnan(model.get_buffer(n)).any()
        ]
        if unset:
            raise ValueError(
                f"init_fn left buffers {unset} unset; they cannot be recomputed from the model's construction"
            )
    return model


# ----------------------------------------------------------------------------------------------
# Pretrained weights


@dataclass
class LoadResult:
    """What `load_pretrained` did on this rank."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes_read: int = 0  # bytes this rank read from the files (its shards only, where it could)
    seconds: float = 0.0


def _checkpoint_files(hf_dir: Path) -> dict[str, Path]:
    """checkpoint key -> file, from the index of a sharded checkpoint or the single file."""
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"load_pretrained: {hf_dir} is not a directory")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"load_pretrained: {index} has no weight_map")
        files = {k: hf_dir / v for k, v in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"load_pretrained: {index} names files that are not there: {absent}")
        return files
    single = hf_dir / "model.safetensors"
    candidates = [single] if single.is_file() else sorted(hf_dir.glob("*.safetensors"))
    if not candidates:
        found = sorted(p.name for p in hf_dir.iterdir())[:10]
        raise FileNotFoundError(
            f"load_pretrained: no model.safetensors, model.safetensors.index.json or *.safetensors in {hf_dir} "
            f"(found {found}); .bin / .pt checkpoints are not read (they unpickle code): convert them first"
        )
    probe = _Reader({})
    return {k: path for path in candidates for k in probe.header(path)[1] if k != "__metadata__"}


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every clean model key (tied names included) -> tensor, and tied name -> first name."""
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = clean_fqn(name)
        tensors[name] = p
        aliases[name] = first.setdefault(id(p), name)
    persistent = {
        (f"{mn}.{bn}" if mn else bn)
        for mn, m in model.named_modules(remove_duplicate=False)
        for bn in m._buffers
        if bn not in m._non_persistent_buffers_set
    }
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in persistent and b is not None:
            tensors[clean_fqn(name)] = b
            aliases[clean_fqn(name)] = first.setdefault(id(b), clean_fqn(name))
    return tensors, aliases


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
}  # fmt: skip


class _Reader:
    """Reads tensors, or only the rows a rank needs, from safetensors files with plain file reads.

    A safetensors file is an 8-byte header length, a JSON header (dtype, shape and byte range of
    every tensor) and the raw row-major data, so rows ``[a, b)`` of a tensor are one contiguous
    byte range: we read exactly that, straight into the destination when the dtypes agree.
    Reading with ``readinto`` rather than through a memory map keeps the checkpoint's page-cache
    pages out of the process (a mapped file counts in its resident set for as long as it is
    mapped), so a rank's memory during the load is its shards and one tensor's rows, no more.
    """

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.headers: dict[Path, tuple[int, dict]] = {}
        self.handles: dict[Path, object] = {}
        self.bytes = 0

    def header(self, path: Path) -> tuple[int, dict]:
        """(byte offset of the data, the JSON header) of one file."""
        if path not in self.headers:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
                n = int.from_bytes(head, "little")
                if n > 100_000_000 or n > path.stat().st_size - 8:
                    raise ValueError(f"{path} is not a safetensors file (header length {n})")
                self.headers[path] = (8 + n, json.loads(f.read(n)))
        return self.headers[path]

    def _entry(self, key: str) -> tuple[Path, int, dict]:
        path = self.files[key]
        start, header = self.header(path)
        if key not in header:
            raise KeyError(f"{key} is not in {path} (the index says it is)")
        return path, start, header[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)[2]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        name = self._entry(key)[2]["dtype"]
        if name not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: safetensors dtype {name} is not supported")
        return _SAFETENSORS_DTYPES[name]

    def read(
        self, key: str, index: tuple[slice, ...] | None = None, *, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor ``key``, or ``key[index]``; with ``into``, copied into that tensor (returned)."""
        path, data_start, entry = self._entry(key)
        shape, dtype = self.shape(key), self.dtype(key)
        begin, end = entry["data_offsets"]
        rows = index[0].indices(shape[0]) if index and shape else (0, shape[0] if shape else 1, 1)
        row_bytes = (end - begin) // max(shape[0], 1) if shape else end - begin
        first, last = rows[0], max(rows[0], rows[1])
        part_shape = (last - first, *shape[1:]) if shape else ()
        rest = tuple(index[1:]) if index else ()
        whole_rows = all(s.indices(n) == (0, n, 1) for s, n in zip(rest, shape[1:]))
        direct = (
            into is not None
            and whole_rows
            and into.dtype == dtype
            and into.is_contiguous()
            and into.device.type == "cpu"
        )
        buf = into if direct else torch.empty(part_shape, dtype=dtype)
        nbytes = (last - first) * row_bytes
        if tuple(buf.shape) != part_shape:
            raise RuntimeError(
                f"internal: {key} rows {first}:{last} have shape {part_shape}, destination {tuple(buf.shape)}"
            )
        if nbytes:
            view = (
                memoryview(buf.view(torch.uint8).reshape(-1).numpy())
                if buf.dim()
                else memoryview(buf.reshape(1).view(torch.uint8).numpy())
            )
            if path not in self.handles:
                self.handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
            f = self.handles[path]
            f.seek(data_start + begin + first * row_bytes)
            done = 0
            while done < nbytes:
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"{path} ends inside {key}: the file is truncated")
                done += got
        self.bytes += nbytes
        part = buf if whole_rows else buf[(slice(None), *rest)]
        if into is not None and not direct:
            into.copy_(part)
            return into
        return part

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()


def load_pretrained(model: nn.Module, hf_dir: str | os.PathLike, *, strict: bool = True) -> LoadResult:
    """Read a local Hugging Face safetensors checkpoint straight into each rank's shards.

    Call it after `shard_model`, on every rank (the model may still be on the meta device: its
    storage is allocated here). Each rank reads, for every tensor, only the part its shard
    holds, as the DTensor's placements say: rows ``[a, b)`` of FSDP's ``torch.chunk`` split on
    the "shard" mesh dimension, everything along "replicate" (every replica group reads its
    own copy). Rows are one contiguous byte range of a safetensors file: they are read with
    plain file reads, straight into the shard when the dtypes agree, and never memory-mapped,
    so a rank's memory is its shards plus one tensor's rows in the file's dtype when they do not
    (benchmarks/results/load_pretrained.md). No rank ever holds the full model; a checkpoint
    whose layout differs from the model's adds one converted tensor at a time.

    Checkpoints whose keys or layout differ from the module (legacy names, MoE experts stored
    one per key but held fused) are mapped with transformers' own renamings and weight
    converters, exactly as ``from_pretrained`` would. A fusing converter whose fused dimension
    is the sharded one reads only this rank's experts; any other conversion reads the whole
    source tensors of that one weight, converts, and keeps this rank's rows.

    Values are cast to each parameter's dtype (the master dtype, e.g. fp32 for bf16 files).
    A tied weight needs only one of its names on disk.

    With ``strict=True`` (the default) a key the model needs but the checkpoint lacks, a key the
    checkpoint has but the model does not, or a shape that differs, is a ``ValueError`` naming
    the keys, raised before anything is read. With ``strict=False`` mismatched shapes still
    raise, and the missing / unexpected keys are returned; missing parameters keep the values
    `materialize` gives them (it is run first when the model is still on the meta device).

    Non-persistent buffers (not in checkpoints) are recomputed as in `materialize`.
    """
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    with _all_ranks_or_none(model, "load_pretrained"):
        files = _checkpoint_files(hf_dir)
        reader = _Reader(files)
        shapes = {k: reader.shape(k) for k in files}
        tensors, aliases = _model_tensors(model)
        plan = plan_load(model, shapes, tensors, aliases)
        problems = []
        if plan.mismatched:
            problems.append(f"shapes differ: {fmt_list(plan.mismatched, 6)}")
        if strict and plan.missing:
            problems.append(f"missing from the checkpoint: {fmt_list(plan.missing)}")
        if strict and plan.unexpected:
            problems.append(f"in the checkpoint but not in the model: {fmt_list(plan.unexpected)}")
        if problems:
            hint = " Is this the checkpoint of another model?" if len(plan.groups) < len(tensors) // 2 else ""
            raise ValueError(f"load_pretrained({hf_dir}) into {type(model).__name__}: " + "; ".join(problems) + hint)
    if plan.missing and any(t.is_meta for t in tensors.values()):
        materialize(model)  # the parameters the checkpoint lacks get the model's own init
    else:
        device = _target_device(model, None)
        with _all_ranks_or_none(model, "load_pretrained"):
            _, buffers = _allocate(model, device)
            _fill_buffers(model, buffers, missing_ok=False)
    tensors, _ = _model_tensors(model)  # allocation may have replaced plain (unsharded) tensors

    result = LoadResult(missing_keys=plan.missing, unexpected_keys=plan.unexpected, files=len(set(files.values())))
    with _all_ranks_or_none(model, "load_pretrained"), torch.no_grad():
        try:
            for group in plan.groups:
                _load_group(model, group, tensors, reader)
                result.tensors += len(group.targets)
        finally:
            result.bytes_read = reader.bytes
            reader.close()
    result.seconds = time.perf_counter() - start
    return result


def _copy_into(target: torch.Tensor, part: torch.Tensor) -> None:
    local = _local(target)
    if tuple(part.shape) != tuple(local.shape):
        raise RuntimeError(
            f"internal: read a part of shape {tuple(part.shape)} for a shard of shape {tuple(local.shape)}"
        )
    local.copy_(part)


def _load_group(model: nn.Module, group, tensors: dict[str, torch.Tensor], reader: _Reader) -> None:
    if group.converter is None:
        target = tensors[group.targets[0]]
        local = _local(target)
        if local.numel() == 0:
            return
        if local.device.type == "cpu":  # straight from the file into the shard when dtypes agree
            reader.read(group.source_keys[0], _local_index(target), into=local)
        else:
            _copy_into(target, reader.read(group.source_keys[0], _local_index(target)))
        return
    target = tensors[group.targets[0]]
    index = _local_index(target)
    whole_inner = all(s.indices(n) == (0, n, 1) for s, n in zip(index[1:], target.shape[1:]))
    if group.merges_dim0() and whole_inner:
        # The target's dim 0 is the list of sources (experts) and only dim 0 is sharded: this
        # rank reads its own experts and nothing else.
        if _local(target).numel() == 0:
            return
        parts = {}
        for keys in group.sources.values():
            for i in range(*index[0].indices(len(keys))):
                parts[keys[i]] = reader.read(keys[i])
        _copy_into(target, group.convert(model, parts)[group.targets[0]])
        return
    # General conversion: whole sources for this one weight, then this rank's part of each output.
    parts = {k: reader.read(k) for k in group.source_keys}
    for name, full in group.convert(model, parts).items():
        target = tensors[name]
        _copy_into(target, full[_local_index(target)])
