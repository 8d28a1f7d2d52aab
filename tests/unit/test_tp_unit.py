"""make_mesh's tp dimension, the TP style table and apply_tensor_parallel's checks, in a world of one."""

from __future__ import annotations

import pytest
import torch.nn as nn
from models import TinyGPT, tiny_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fsdp2kit as fk
from fsdp2kit.dist import data_parallel_mesh
from fsdp2kit.parallel.styles import STYLE_NAMES, resolve_style, weight_placement
from fsdp2kit.parallel.tensor_parallel import model_tp_plan


def test_make_mesh_tp_sizes(mesh):
    assert fk.make_mesh(tp=1).mesh_dim_names == ("shard",)
    with pytest.raises(
        ValueError, match=r"tp=2 does not fit the world size 1; sizes that work: \(shard=1, replicate=1\)"
    ):
        fk.make_mesh(tp=2)
    with pytest.raises(ValueError, match=r"tp=-1 must be a positive int"):
        fk.make_mesh(tp=-1)


def test_data_parallel_mesh(mesh):
    assert data_parallel_mesh(mesh) is mesh
    two = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "tp"))
    assert data_parallel_mesh(two).mesh_dim_names == ("shard",)
    only_tp = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="has a tp dimension but no data-parallel one"):
        data_parallel_mesh(only_tp)


def test_model_plan_and_styles():
    plan = model_tp_plan(tiny_llama(tied=True))
    assert plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert model_tp_plan(TinyGPT()) == {}
    lin, emb = nn.Linear(4, 4), nn.Embedding(8, 4)
    assert weight_placement(lin, resolve_style("colwise", "x")) == Shard(0)
    assert weight_placement(lin, resolve_style("rowwise", "x")) == Shard(1)
    assert weight_placement(emb, resolve_style("embedding_rowwise", "x")) == Shard(0)
    assert weight_placement(emb, resolve_style("embedding_colwise", "x")) == Shard(1)
    assert weight_placement(lin, resolve_style("replicated_with_grad_allreduce", "x")) == Replicate()
    assert resolve_style("replicate", "x") is None and "colwise" in STYLE_NAMES
    with pytest.raises(ValueError, match="style 'moe_tp_experts' is not supported"):
        resolve_style("moe_tp_experts", "layers.0.mlp.experts")


def test_apply_tensor_parallel_needs_a_plan(mesh):
    tp_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "tp"))
    with pytest.raises(ValueError, match="TinyGPT has no tensor-parallel plan of its own"):
        fk.apply_tensor_parallel(TinyGPT(), tp_mesh)
    with pytest.raises(ValueError, match="plan must be 'auto' or a mapping"):
        fk.apply_tensor_parallel(TinyGPT(), tp_mesh, plan="megatron")
    with pytest.raises(ValueError, match="names a parameter, not a module"):
        fk.apply_tensor_parallel(TinyGPT(), tp_mesh, plan={"pos": "colwise"})


def test_planned_shapes_and_divisibility():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp2kit.parallel.tensor_parallel import planned_tp_shapes

    model = tiny_llama()  # hidden 40, 4 heads, 2 KV heads, MLP 56, vocab 96
    shapes = planned_tp_shapes(model, 2)
    attn = model.model.layers[0].self_attn
    assert shapes[id(attn.q_proj.weight)] == (20, 40) and shapes[id(attn.o_proj.weight)] == (40, 20)
    assert shapes[id(model.model.embed_tokens.weight)] == (48, 40)
    assert id(model.model.norm.weight) not in shapes
    odd = LlamaForCausalLM(
        LlamaConfig(vocab_size=96, hidden_size=30, intermediate_size=56, num_hidden_layers=1, num_attention_heads=3)
    )
    with pytest.raises(ValueError, match=r"config\.num_attention_heads = 3, config\.num_key_value_heads = 3"):
        planned_tp_shapes(odd, 2)
    # A plan that splits only the MLP does not depend on the head count.
    mlp_only = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    assert len(planned_tp_shapes(odd, 2, mlp_only)) == 2
    with pytest.raises(ValueError, match=r"intermediate_size = 56.*mlp\.up_proj\.weight dim 0"):
        planned_tp_shapes(model, 3, mlp_only)
