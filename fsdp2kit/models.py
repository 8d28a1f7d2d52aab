"""Named Llama-style configs (from published config.json files); weightless causal LMs from one or a local HF dir."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from fsdp2kit._internal.quiet import quiet_imports

__all__ = ["NAMED_CONFIGS", "build_causal_lm", "causal_lm_config", "llama_config", "max_positions"]

_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
_BENCH = dict(vocab_size=8192, max_position_embeddings=2048)
# name -> LlamaConfig arguments: hidden, intermediate, layers, heads, kv heads, then the rest.
NAMED_CONFIGS: dict[str, dict] = {
    name: {**dict(zip(_FIELDS, shape)), **rest}
    for name, shape, rest in [
        # A few hundred thousand parameters: trains visibly on a CPU in a minute (`make demo`).
        ("demo", (128, 352, 4, 4, 4), dict(vocab_size=256, max_position_embeddings=512)),
        # Benchmark sizes (issue: FSDP1 vs FSDP2): hidden x layers.
        ("bench-256x4", (256, 688, 4, 4, 4), _BENCH),
        ("bench-512x8", (512, 1376, 8, 8, 8), _BENCH),
        ("bench-768x6", (768, 2048, 6, 12, 12), _BENCH),
        ("llama3-8b", (4096, 14336, 32, 32, 8), _LLAMA3),
        ("llama3-70b", (8192, 28672, 80, 64, 8), _LLAMA3),
        # Llama 3.1 405B's shapes (its rope scaling left out: it changes no tensor size).
        ("llama3-405b", (16384, 53248, 126, 128, 8), _LLAMA3),
    ]
}


def llama_config(name: str, **overrides):
    from transformers import LlamaConfig

    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown model name {name!r}: use one of {sorted(NAMED_CONFIGS)} or a local directory")
    return LlamaConfig(**{**NAMED_CONFIGS[name], **overrides})


def causal_lm_config(
    name: str,
    *,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    max_position_embeddings: int | None = None,
):
    """The transformers config `build_causal_lm` builds from: a named config or a local HF directory's.
    ``vocab_size``/``max_seq_len`` adapt a named config to the data; ``max_position_embeddings`` sets the
    position limit of either (the user's statement that longer sequences are meant)."""
    from transformers import AutoConfig

    if max_position_embeddings is not None and (
        isinstance(max_position_embeddings, bool) or max_position_embeddings < 1
    ):
        raise ValueError(f"max_position_embeddings={max_position_embeddings!r}: expected a positive int")
    if Path(name).is_dir():
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"model directory {name} has no config.json")
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    else:
        config = llama_config(name)
        if vocab_size is not None:
            config.vocab_size = vocab_size
        if max_seq_len is not None:
            config.max_position_embeddings = max(max_seq_len, config.max_position_embeddings)
    if max_position_embeddings is not None:
        config.max_position_embeddings = max_position_embeddings
    return config


def max_positions(model_or_config) -> int | None:
    """The longest sequence a model's config says it handles (``max_position_embeddings``), or None."""
    config = getattr(model_or_config, "config", model_or_config)
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def build_causal_lm(name: str, *, meta: bool = True, device: torch.device | str = "cpu", **config_args) -> nn.Module:
    """A randomly initialised causal LM from `causal_lm_config` (``config_args`` are its keyword arguments): on the
    meta device (shard it, then `fsdp2kit.materialize` or `fsdp2kit.load_pretrained`), or with ``meta=False`` on
    ``device``."""
    from transformers import AutoModelForCausalLM

    config = causal_lm_config(name, **config_args)
    with torch.device("meta" if meta else device), quiet_imports():
        return AutoModelForCausalLM.from_config(config)
