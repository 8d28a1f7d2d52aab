"""A model's repeated blocks (by what it declares, else its structure; never by names) and its shared parameters."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch.nn as nn

__all__ = ["BlockSpec", "find_blocks", "shared_parameters"]

BlockSpec = str | type | Sequence[type] | Callable[[nn.Module], bool]


def _outermost(model: nn.Module, match: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules that match, in registration order, skipping any nested inside a match."""
    found: list[nn.Module] = []
    for child in model.children():
        found += [child] if match(child) else _outermost(child, match)
    return found


def _largest_repeated_children(model: nn.Module) -> list[nn.Module]:
    """The largest set of same-class siblings by parameter count (decoder layers, not the experts inside)."""
    groups: list[list[nn.Module]] = []
    for parent in model.modules():
        by_class: dict[type, list[nn.Module]] = defaultdict(list)
        for child in parent.children():
            by_class[type(child)].append(child)
        groups += [siblings for siblings in by_class.values() if len(siblings) > 1]
    return max(groups, key=lambda s: sum(p.numel() for m in s for p in m.parameters()), default=[])


def find_blocks(model: nn.Module, blocks: BlockSpec = "auto") -> list[nn.Module]:
    """The modules to shard as units, outermost first, in registration order.

    ``blocks`` is one of:
    - ``"auto"``: the classes the model declares in ``_no_split_modules`` (every Hugging Face
      model does), else the largest group of same-class sibling modules (by parameter count);
    - a class, or a list of classes: every outermost module that is an instance of one;
    - a predicate ``fn(module) -> bool``: every outermost module for which it is true.

    The root itself is never a block. Raises ``ValueError`` when nothing is found, because
    sharding a transformer as one unit silently gives up FSDP's memory saving.
    """
    if isinstance(blocks, str):
        if blocks != "auto":
            raise ValueError(f"blocks={blocks!r}: the only string accepted is 'auto'; pass classes or a predicate")
        # transformers' _no_split_modules: composite models declare them on their sub-models
        declared = {c for m in model.modules() for c in getattr(m, "_no_split_modules", None) or ()}
        found = _outermost(model, lambda m: type(m).__name__ in declared) or _largest_repeated_children(model)
        how = f"no module of its _no_split_modules classes {sorted(declared)}" if declared else "no _no_split_modules"
        how += " and no group of two or more same-class sibling modules with parameters"
    elif isinstance(blocks, type) or (
        isinstance(blocks, Sequence) and blocks and all(isinstance(b, type) for b in blocks)
    ):
        classes = (blocks,) if isinstance(blocks, type) else tuple(blocks)
        bad = [c for c in classes if not issubclass(c, nn.Module)]
        if bad:
            raise TypeError(f"blocks: {bad} are not nn.Module subclasses")
        found = _outermost(model, lambda m: isinstance(m, classes))
        how = f"no module is an instance of {[c.__name__ for c in classes]}"
    elif callable(blocks):
        found = _outermost(model, lambda m: bool(blocks(m)))
        how = f"the predicate {getattr(blocks, '__name__', blocks)!r} matched no module"
    else:
        raise TypeError(
            f"blocks must be 'auto', a module class, a list of module classes or a predicate; got {blocks!r}"
        )
    found = [m for m in found if any(True for _ in m.parameters())]
    if not found:
        raise ValueError(
            f"found no blocks to shard in {type(model).__name__}: {how}. Pass the block class, "
            "e.g. shard_model(model, mesh, blocks=[MyBlock]), or a predicate."
        )
    return found


def shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    """Parameters registered under more than one name (tied weights): id -> every qualified name."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return {pid: ns for pid, ns in names.items() if len(ns) > 1}


def tied_slots(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """Slots (module name, module, parameter name) that share one parameter, for every shared parameter."""
    slots: dict[int, list[tuple[str, nn.Module, str]]] = defaultdict(list)
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None and all(m is not module or n != pname for _, m, n in slots[id(p)]):
                slots[id(p)].append((mname, module, pname))
    return [group for group in slots.values() if len(group) > 1]
