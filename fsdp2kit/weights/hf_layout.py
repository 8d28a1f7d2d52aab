"""What fsdp2kit asks of transformers: module identity, clean names, the on-disk layout (docs/internals.md)."""

from __future__ import annotations

import copy
import functools
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp2kit._internal.quiet import quiet_imports

# Wrapper modules that insert a path segment without changing what the module holds:
# torch's checkpoint_wrapper, torch.compile's OptimizedModule and FSDP1. DCP's own state-dict
# helpers drop the same segments, so names match what `get_model_state_dict` writes.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def clean_fqn(name: str) -> str:
    """A parameter's name as the unwrapped model (and its checkpoint) spells it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def original_class(module: nn.Module) -> type:
    """The class a module was built as: FSDP2 swaps in a subclass named ``FSDP<Class>``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        return cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    return cls


def is_instance_of(obj: object, package: str, name: str) -> bool:
    """``isinstance(obj, package.name)``, without importing ``package`` when nothing has (then it is False)."""
    return package in sys.modules and isinstance(obj, getattr(sys.modules[package], name))


def is_pretrained(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return is_instance_of(module, "transformers", "PreTrainedModel")


def natural_key(key: str) -> list:
    """Sort key that orders ``experts.2`` before ``experts.10`` (transformers' own order)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


def _as_built(model: nn.Module) -> nn.Module:
    """A meta twin of the model if FSDP2 renamed its classes (transformers finds conversions by class name)."""
    if all(type(m) is original_class(m) for m in model.modules()):
        return model
    with torch.device("meta"), quiet_imports():
        twin = original_class(model)(copy.deepcopy(model.config))
    if getattr(model, "_weight_conversions", None) is not None:  # set by from_pretrained
        twin._weight_conversions = model._weight_conversions
    return twin


def _conversions(model: nn.Module, *, for_saving: bool) -> list:
    """transformers' renamings and converters for ``model``; empty for anything else."""
    if not is_pretrained(model):
        return []
    model = _as_built(model)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4.x: no weight conversions to apply
        return []
    if for_saving:
        # What transformers' own save does for a model that was not loaded by from_pretrained:
        # no legacy renames, and no prefix changes (nothing says the prefix was ever there).
        found = get_model_conversion_mapping(model, add_legacy=False)
        return [t for t in found if not isinstance(t, PrefixChange)]
    return get_model_conversion_mapping(model)


@dataclass
class Group:
    """Model keys filled together from some checkpoint keys: a plain rename (one source, one target),
    or a converter merging many sources into one target (MoE experts) or splitting one."""

    targets: list[str]
    sources: dict[str, list[str]]  # source pattern -> checkpoint keys, in transformers' order
    converter: Any = None  # a transformers WeightConverter, or None for a plain (renamed) copy

    @property
    def source_keys(self) -> list[str]:
        return [k for keys in self.sources.values() for k in keys]

    def convert(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the converter on ``tensors`` (checkpoint key -> tensor); returns model key -> tensor."""
        conv = copy.deepcopy(self.converter)
        for pattern, keys in self.sources.items():
            for key in keys:
                if key in tensors:  # a rank leaves out the experts it does not hold
                    conv.add_tensor(self.targets[0], key, pattern, tensors[key])
        out = conv.convert(self.targets[0], model=model, config=getattr(model, "config", None))
        return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}

    def merges_dim0(self) -> bool:
        """Whether dim 0 of the result is the list of sources, so a rank converts the sources of its own rows alone."""
        from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose  # as the converter

        ops = list(self.converter.operations)
        if len(self.targets) != 1 or not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
            return False
        return all(  # later ops that leave dim 0 alone
            (type(op) is Concatenate and op.dim >= 1) or (type(op) is Transpose and op.dim0 >= 1 and op.dim1 >= 1)
            for op in ops[1:]
        )


def _not_ignored(model: nn.Module, keys: Iterable[str], attribute: str) -> list[str]:
    """``keys`` in natural order, less those a transformers model declares may be missing / unexpected (regexes)."""
    patterns = set(getattr(model, attribute, None) or ())
    if attribute == "_keys_to_ignore_on_load_unexpected":
        # transformers also ignores these two, which older checkpoints stored as persistent buffers.
        patterns |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns and is_pretrained(model) else None
    return sorted({k for k in keys if regex is None or not regex.search(k)}, key=natural_key)


def plan_load(
    model: nn.Module,
    disk_shapes: dict[str, tuple[int, ...]],
    model_tensors: dict[str, torch.Tensor],
    aliases: dict[str, str],
) -> tuple[list[Group], list[str], list[str], list[str]]:
    """Checkpoint keys matched to model keys as from_pretrained does (``aliases``: tied name -> first name), conversions
    dry-run on meta. Returns the groups to load, missing model keys, unexpected checkpoint keys, shape mismatches."""
    transforms = _conversions(model, for_saving=False)
    loads, unexpected, mismatched = [], [], []  # of Group, checkpoint key, message
    if transforms:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None) or None
    groups: dict[str, Group] = {}
    for key in sorted(disk_shapes, key=natural_key):
        target, pattern = key, None
        if transforms:
            target, pattern = rename_source_key(key, renamings, converters, prefix, model_tensors)
            if target not in model_tensors and key in model_tensors:
                target, pattern = key, None
        # No place in the model, or a second checkpoint key for one model key (e.g. legacy and new names).
        if target not in model_tensors or (pattern is None and target in groups):
            unexpected.append(key)
            continue
        group = groups.setdefault(target, Group([target], {}, by_pattern[pattern] if pattern else None))
        group.sources.setdefault(pattern or key, []).append(key)

    filled: set[str] = set()
    for first, group in groups.items():
        if group.converter is not None:
            metas = {k: torch.empty(disk_shapes[k], device="meta") for k in group.source_keys}
            try:
                produced = group.convert(model, metas)
            except Exception as exc:
                mismatched.append(f"{first}: converting {group.source_keys[:4]}... failed: {exc}")
                continue
            group.targets = list(produced)
            shapes = {k: tuple(v.shape) for k, v in produced.items()}
        else:
            shapes = {first: tuple(disk_shapes[group.source_keys[0]])}
        if any(n not in model_tensors for n in shapes):
            unexpected.extend(group.source_keys)
            continue
        src = group.source_keys[0] if group.converter is None else f"{len(group.source_keys)} keys"
        wrong = [
            f"{name}: checkpoint {src} gives shape {shape}, the model has {tuple(model_tensors[name].shape)}"
            for name, shape in shapes.items()
            if shape != tuple(model_tensors[name].shape)
        ]
        mismatched.extend(wrong)
        roots = {aliases.get(n, n) for n in group.targets}
        if not wrong and not roots & filled:  # two checkpoint keys that fill one tied tensor: the first wins
            loads.append(group)
        if not wrong:
            filled |= roots

    # A tied tensor is filled by any one of its names; the others may be absent from the file.
    missing = [k for k in model_tensors if aliases.get(k, k) == k and k not in filled]
    missing = _not_ignored(model, missing, "_keys_to_ignore_on_load_missing")
    return loads, missing, _not_ignored(model, unexpected, "_keys_to_ignore_on_load_unexpected"), mismatched


def save_layout(model: nn.Module, keys: list[str]) -> tuple[list[list[str]], Callable[[dict], dict]]:
    """``keys`` grouped so that every reverse conversion sees all of its inputs at once, and the function that
    puts one group of full tensors under the checkpoint's keys: the model's usual layout, as transformers saves it."""
    model = _as_built(model) if is_pretrained(model) else model
    conversions = _conversions(model, for_saving=True)
    if not conversions:
        return [[k] for k in keys], lambda tensors: tensors
    from transformers.core_model_loading import WeightConverter, apply_converters, revert_weight_conversion

    converters = [t.reverse_transform() for t in conversions[::-1] if isinstance(t, WeightConverter)]
    order: dict[str, list[str]] = {}
    for key in keys:
        renamed, pattern = apply_converters(key, converters)  # (key, None) where none applies
        order.setdefault(renamed if pattern is not None else key, []).append(key)
    return list(order.values()), functools.partial(revert_weight_conversion, model)


def model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every clean model key of the state dict (tied names included) -> tensor, and tied name -> first name."""
    state = model.state_dict(keep_vars=True)  # not a tensor: a module's get_extra_state() entry
    tensors = {clean_fqn(name): t for name, t in state.items() if isinstance(t, torch.Tensor)}
    first: dict[int, str] = {}
    return tensors, {name: first.setdefault(id(t), name) for name, t in tensors.items()}
