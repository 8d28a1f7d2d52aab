"""When `load_pretrained` may skip transformers' conversion table: only when no conversion can apply."""

from __future__ import annotations

import pytest
import torch

import fsdp2kit.weights.conversion_index as ci
from fsdp2kit._internal.scoped import skipping_meta_init
from fsdp2kit.weights.hf_layout import model_tensors, plan_load


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), skipping_meta_init():
        return AutoModelForCausalLM.from_config(config)


def _llama():
    from transformers import LlamaConfig

    return _meta(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2))  # fmt: skip


def _built_table():
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")  # builds transformers' table in this process
    return ci.loaded_table()


@pytest.mark.timeout(60)
def test_index_file_round_trip(tmp_path, monkeypatch):
    table = _built_table()
    monkeypatch.setenv("FSDP2KIT_CACHE_DIR", str(tmp_path))
    assert ci.known_index(use_loaded=False) is None  # nothing remembered yet
    ci.remember_index()
    files = list(tmp_path.glob("transformers-*-conversions-*.json"))
    assert len(files) == 1
    index = ci.known_index(use_loaded=False)
    assert index == ci.known_index() and set(index["keys"]) == set(table) and index["legacy"]
    files[0].write_text("{not json")  # a broken cache is ignored, not trusted
    assert ci.known_index(use_loaded=False) is None
    monkeypatch.setenv("FSDP2KIT_CACHE_DIR", "")  # turned off
    assert ci.known_index(use_loaded=False) is None


@pytest.mark.timeout(60)
def test_needs_no_conversion_only_when_none_applies(monkeypatch):
    from transformers import MixtralConfig

    _built_table()
    llama = _llama()
    tensors, aliases = model_tensors(llama)
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    assert ci.needs_no_conversion(llama, shapes, tensors)
    # the same plan either way
    fast, full = (plan_load(llama, shapes, tensors, aliases, convert=c) for c in (False, True))
    assert [(g.targets, g.sources, g.converter) for g in fast.groups] == [
        (g.targets, g.sources, g.converter) for g in full.groups
    ]
    assert (fast.missing, fast.unexpected, fast.mismatched) == (full.missing, full.unexpected, full.mismatched)
    # a key the model does not have: transformers' renamings must decide
    assert not ci.needs_no_conversion(llama, {**shapes, "model.layers.0.LayerNorm.gamma": (32,)}, tensors)
    # a model type with conversions of its own (MoE experts fused on load), even with the model's own keys
    mixtral = _meta(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=2))  # fmt: skip
    m_tensors, _ = model_tensors(mixtral)
    assert not ci.needs_no_conversion(mixtral, {k: tuple(t.shape) for k, t in m_tensors.items()}, m_tensors)
    # a legacy renaming that matches one of the keys, or no index at all: the full path
    monkeypatch.setattr(ci, "known_index", lambda **_: {"keys": [], "legacy": [r"self_attn\.q_proj"]})
    assert not ci.needs_no_conversion(llama, shapes, tensors)
    monkeypatch.setattr(ci, "known_index", lambda **_: None)
    assert not ci.needs_no_conversion(llama, shapes, tensors)
