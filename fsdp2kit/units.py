"""Which modules form each FSDP unit: embedding groups with their tied heads, and dtype sub-units."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn

from fsdp2kit._internal.fmt import fmt_list

__all__ = ["assign_units", "dtype_subunits"]


def assign_units(model: nn.Module, blocks: list[nn.Module]) -> tuple[list[list[nn.Module]], dict[int, str]]:
    """Embedding groups outside the blocks, and each parameter's unit (by id); raises if a parameter shared
    between modules would end up in two units (the other would compute with the sharded tensor)."""
    names = {id(m): n for n, m in model.named_modules()}

    # The name of the block each module lives in (None: outside every block).
    home: dict[int, str | None] = {id(m): None for m in model.modules()}
    for b in blocks:
        home.update((id(m), names[id(b)]) for m in b.modules())

    # Which modules register each parameter (a tied weight is registered by several).
    owners: dict[int, list[nn.Module]] = defaultdict(list)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)].append(module)

    unit_of: dict[int, str] = {}
    for pid, mods in owners.items():
        if len({home[id(m)] for m in mods}) > 1:
            where = [home[id(m)] or "(outside the blocks)" for m in mods]
            raise ValueError(
                f"tied parameter shared by {[names[id(m)] for m in mods]} would be split across FSDP units {where}; "
                "choose blocks that keep every user of a shared weight in one unit"
            )
        unit_of[pid] = home[id(mods[0])] or ""

    # Embedding groups: each nn.Embedding outside the blocks, with every module that shares a weight with it.
    groups: list[list[nn.Module]] = []
    grouped: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.Embedding) or home[id(module)] is not None or id(module) in grouped:
            continue
        group = list(dict.fromkeys([module, *(o for p in module.parameters(recurse=False) for o in owners[id(p)])]))
        if any(m is model for m in group):
            continue  # the root owns it: it stays in the root unit
        grouped.update(id(m) for m in group)
        groups.append(group)
        label = "+".join(names[id(m)] for m in group)
        unit_of.update((id(p), label) for m in group for p in m.parameters())
    return groups, unit_of


def dtype_subunits(
    model: nn.Module, unit: str, params: dict[str, nn.Parameter], unit_of: dict[int, str]
) -> list[tuple[str, list[nn.Module]]]:
    """Sub-units giving an FSDP unit trainable parameters of one dtype (FSDP2 reduces its gradients in one flat buffer):
    the modules owning each minority dtype's become one unit; raises when one module mixes them itself."""
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    numel: dict[torch.dtype, int] = defaultdict(int)
    for p in trainable.values():
        numel[p.dtype] += p.numel()
    if len(numel) < 2:
        return []
    keep = max(numel, key=lambda d: numel[d])
    label = unit or "(root)"
    out = []
    for dtype in sorted((d for d in numel if d != keep), key=str):
        owners = sorted({n.rpartition(".")[0] for n, p in trainable.items() if p.dtype == dtype})
        outermost = [o for o in owners if not any(o != q and (q == "" or o.startswith(q + ".")) for q in owners)]
        bad = []
        for owner in outermost:
            module = model.get_submodule(owner)
            mixed = [
                f"{owner}.{n}" if owner else n
                for n, p in module.named_parameters()
                if p.requires_grad and p.dtype != dtype and unit_of.get(id(p)) == unit
            ]
            if module is model or (unit and owner == unit) or mixed:
                bad.append(f"{owner or '(root)'} ({', '.join(mixed[:3]) or 'the unit itself'})")
        if bad:
            listing = "; ".join(
                f"{d}: {fmt_list(sorted(n for n, p in trainable.items() if p.dtype == d), 3)}" for d in numel
            )
            raise ValueError(
                f"FSDP unit {label} mixes trainable parameter dtypes ({listing}) inside single modules that cannot "
                f"become units of their own: {fmt_list(bad, 3)}. Give trainable parameters one dtype (e.g. "
                "p.data = p.data.float() for each trainable p) and choose the compute dtype with mixed_precision=..."
            )
        tag = str(dtype).removeprefix("torch.")
        out.append((f"[{tag} trainable: {fmt_list(outermost, 2)}]", [model.get_submodule(o) for o in outermost]))
    return out
