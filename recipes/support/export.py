"""Export at the end of training (`[export] hf_dir`): a Hugging Face model directory with the tokenizer beside it.

This is the one place the recipe decides what is written; with LoRA (`[lora]`) it is where an
adapter directory, or a merged model, is chosen instead. Writing the tokenizer (and its special
token ids into the saved configs) is `fsdp2kit.export_hf`'s, as for any user of the library.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

import fsdp2kit as fk

__all__ = ["export_model"]


def export_model(model: nn.Module, tokenizer, hf_dir: str | Path, *, is_main: bool, merge: bool = True) -> Path | None:
    """Collective: every rank calls it. Writes ``hf_dir`` (replacing an old export there) on one rank,
    the tokenizer beside the weights, so ``from_pretrained(hf_dir)`` gives both. A LoRA model is
    written merged into its base (``merge``), else as the PEFT adapter directory that
    ``PeftModel.from_pretrained(base, hf_dir)`` loads. Returns the directory on the writing rank."""
    peft = hasattr(model, "peft_config")
    out = fk.export_hf(model, hf_dir, overwrite=True, merge=merge and peft, tokenizer=tokenizer)
    if is_main:
        what = "a PEFT adapter" if peft and not merge else "a Hugging Face model"
        print(f"exported {what} and its tokenizer to {Path(hf_dir).resolve()}", flush=True)
    return out
