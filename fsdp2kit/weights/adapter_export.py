"""export_hf for peft models: PEFT's own adapter directory, or the base with the adapters merged in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from fsdp2kit._internal.agree import raise_agreed
from fsdp2kit._internal.dtensor import gather_full, is_first_rank
from fsdp2kit.weights.adapters import adapter_keys, base_name, merged_weight, peft_view
from fsdp2kit.weights.hf_writer import StagedDir
from fsdp2kit.weights.nf4 import is_nf4

__all__ = ["export_adapters", "merged_source"]


def merged_source(
    model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]
) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, str], Callable[[str], torch.Tensor]]:
    """What export_hf writes for ``merge=True``: the wrapped model, its tensors under its own names,
    and a collective function that gathers one of them with the active LoRA adapters folded in."""
    view = peft_view(model, tensors, for_merge=True)
    base = {b: tensors[n] for b, n in view.names.items()}
    base_aliases = {b: base_name(aliases.get(n, n)) for b, n in view.names.items()}

    def full_of(name: str) -> torch.Tensor:
        weight = gather_full(base[name])
        factors = [
            (gather_full(tensors[m.a]), gather_full(tensors[m.b]), m.scaling, m.fan_in_fan_out)
            for m in view.merges.get(name, [])
        ]
        return merged_weight(weight, factors) if factors or is_nf4(weight) else weight

    return view.inner, base, base_aliases, full_of


def export_adapters(
    model: nn.Module,
    out_dir: Path,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype | None,
    overwrite: bool,
    last: Callable[[Path], None] | None = None,
) -> Path | None:
    """PEFT's adapter directory from full adapter tensors, gathered one at a time to the first rank.

    peft itself (``PeftModel.save_pretrained`` given the full tensors as its state dict) picks
    the keys, names them, writes ``adapter_model.safetensors`` and ``adapter_config.json`` (in
    inference mode, with the base model's class for auto-loading): the output is what peft
    writes for an unsharded model, one subdirectory per adapter other than ``default``.
    ``last(directory)`` writes more files (the tokenizer) before the directory is published.
    """
    writer_rank = is_first_rank(model)
    error: BaseException | None = None
    stage: StagedDir | None = None
    if writer_rank:
        try:
            stage = StagedDir(out_dir, overwrite)
        except BaseException as exc:
            error = exc
    with torch.no_grad():
        for adapter in list(model.peft_config):
            fulls = {}
            for name in adapter_keys(model, adapter, tensors):
                full = gather_full(tensors[name])  # collective: every rank gathers every adapter tensor, in order
                if stage is not None:
                    if dtype is not None and full.is_floating_point():
                        full = full.to(dtype)
                    fulls[name] = full.cpu().contiguous()
            if stage is None or error is not None:
                continue
            try:
                model.save_pretrained(
                    str(stage.dir), selected_adapters=[adapter], state_dict=fulls, save_embedding_layers=False
                )
            except BaseException as exc:
                error = exc
    if stage is not None:
        error = stage.close(error, (lambda: last(stage.dir)) if last is not None else (lambda: None))
    raise_agreed(error, model, "export_hf")
    return out_dir if writer_rank else None
