"""Export at the end of training (`[export] hf_dir`): a Hugging Face model directory with the tokenizer beside it.

This is the one place the recipe decides what is written; with LoRA (`[lora]`) it is where an
adapter directory, or a merged model, is chosen instead.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

import fsdp2kit as fk

__all__ = ["align_special_tokens", "export_model"]


def align_special_tokens(model: nn.Module, tokenizer) -> None:
    """Give the model's config (and generation config) the tokenizer's BOS/EOS/PAD ids, so the exported
    model's ``generate`` stops at the tokenizer's EOS. Named configs carry Llama's defaults otherwise."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    ids["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is not None:
            for key, value in ids.items():
                setattr(config, key, value)


def export_model(model: nn.Module, tokenizer, hf_dir: str | Path, *, is_main: bool, merge: bool = True) -> Path | None:
    """Collective: every rank calls it. Writes ``hf_dir`` (replacing an old export there) on one rank,
    then the tokenizer beside the weights, so ``from_pretrained(hf_dir)`` gives both. A LoRA model is
    written merged into its base (``merge``), else as the PEFT adapter directory that
    ``PeftModel.from_pretrained(base, hf_dir)`` loads. Returns the directory on the writing rank."""
    align_special_tokens(model, tokenizer)
    peft = hasattr(model, "peft_config")
    out = fk.export_hf(model, hf_dir, overwrite=True, merge=merge and peft)
    if out is not None:
        tokenizer.save_pretrained(str(out))
    if is_main:
        what = "a PEFT adapter" if peft and not merge else "a Hugging Face model"
        print(f"exported {what} and its tokenizer to {Path(hf_dir).resolve()}", flush=True)
    return out
