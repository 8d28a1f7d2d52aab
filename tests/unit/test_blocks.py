"""Block detection across model families, without matching module names."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers as tf
from models import Block, TinyGPT

from fsdp2kit import find_blocks

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)

HF_FAMILIES = [
    ("llama", tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    ("qwen2", tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    ("qwen3", tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 8}),
    ("mistral", tf.MistralConfig, tf.MistralForCausalLM, {}),
    ("gemma2", tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 8}),
    ("phi3", tf.Phi3Config, tf.Phi3ForCausalLM, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    ("mixtral", tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    (
        "qwen3_moe",
        tf.Qwen3MoeConfig,
        tf.Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
    ),
]


@pytest.mark.parametrize("name,config_cls,model_cls,extra", HF_FAMILIES, ids=[f[0] for f in HF_FAMILIES])
def test_auto_finds_hf_decoder_layers(name, config_cls, model_cls, extra):
    with torch.device("meta"):
        model = model_cls(config_cls(**SMALL, **extra))
    blocks = find_blocks(model)
    assert len(blocks) == 3
    assert len({type(b) for b in blocks}) == 1
    assert type(blocks[0]).__name__ in model._no_split_modules


def test_auto_finds_gpt2_blocks():
    with torch.device("meta"):
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32))
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["GPT2Block"] * 4


def test_auto_uses_structure_for_plain_pytorch():
    model = TinyGPT(depth=4)
    assert find_blocks(model) == list(model.trunk)


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8)


class MoELayer(nn.Module):
    def __init__(self, n_experts: int):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(n_experts))


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.Sequential(*(MoELayer(8) for _ in range(2)))


def test_auto_prefers_layers_over_the_more_numerous_experts():
    model = MoEModel()
    assert find_blocks(model) == list(model.layers)


def test_classes_and_predicates():
    model = TinyGPT(depth=2)
    assert find_blocks(model, [Block]) == list(model.trunk)
    assert find_blocks(model, Block) == list(model.trunk)
    assert find_blocks(model, lambda m: isinstance(m, nn.Linear)) == [
        m for m in model.modules() if isinstance(m, nn.Linear)
    ]
    # outermost only: a predicate matching a block and its children keeps the block
    assert find_blocks(model, lambda m: isinstance(m, (Block, nn.Linear)))[:2] == list(model.trunk)


def test_no_blocks_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="found no blocks to shard in Sequential.*blocks=\\[MyBlock\\]"):
        find_blocks(model)
    with pytest.raises(ValueError, match="no module is an instance of \\['Block'\\]"):
        find_blocks(model, [Block])
    with pytest.raises(ValueError, match="only string accepted is 'auto'"):
        find_blocks(model, "layers")
    with pytest.raises(TypeError, match="blocks must be"):
        find_blocks(model, ["Block"])
    with pytest.raises(TypeError, match="not nn.Module subclasses"):
        find_blocks(model, [int])
