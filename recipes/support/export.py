"""Export at the end of training (`[export] hf_dir`): a Hugging Face model directory with the tokenizer beside it.

This is the one place the recipe decides what is written; with LoRA (`[lora]`) it is where an
adapter directory, or a merged model, is chosen instead. Writing the tokenizer (and its special
token ids into the saved configs) is `fsdp2kit.export_hf`'s, as for any user of the library.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

import fsdp2kit as fk

__all__ = ["EXPORT_DTYPES", "export_dtype", "export_model"]

EXPORT_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_dtype(name: str, model: nn.Module, *, adapters: bool = False) -> torch.dtype | None:
    """What ``[export] dtype`` writes: a named dtype, or for "auto" the dtype the model's pretrained
    checkpoint was stored in (its config's ``dtype``: a bf16 Llama is written in bf16 again, though
    trained with fp32 masters), else (no such config, or a PEFT adapter directory, whose adapters
    are trained in the master dtype) None: as held."""
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export.dtype={name!r}; one of {', '.join(EXPORT_DTYPES)}")
    if name != "auto":
        return EXPORT_DTYPES[name]
    config = getattr(model, "config", None)
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if adapters or stored is None:
        return None
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else None


def export_model(
    model: nn.Module, tokenizer, hf_dir: str | Path, *, is_main: bool, merge: bool = True, dtype: str = "auto"
) -> Path | None:
    """Collective: every rank calls it. Writes ``hf_dir`` (replacing an old export there) on one rank,
    the tokenizer beside the weights, so ``from_pretrained(hf_dir)`` gives both. A LoRA model is
    written merged into its base (``merge``), else as the PEFT adapter directory that
    ``PeftModel.from_pretrained(base, hf_dir)`` loads. ``dtype``: see `export_dtype`. Returns the
    directory on the writing rank."""
    peft = hasattr(model, "peft_config")
    cast = export_dtype(dtype, model, adapters=peft and not merge)
    out = fk.export_hf(model, hf_dir, overwrite=True, merge=merge and peft, tokenizer=tokenizer, dtype=cast)
    if is_main:
        what = "a PEFT adapter" if peft and not merge else "a Hugging Face model"
        held = "as trained" if cast is None else str(cast).removeprefix("torch.")
        print(f"exported {what} ({held}) and its tokenizer to {Path(hf_dir).resolve()}", flush=True)
    return out
