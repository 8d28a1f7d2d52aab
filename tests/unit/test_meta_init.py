"""Meta-device construction skips init of meta parameters only, and leaves nothing behind.

`build_causal_lm(meta=True)`, the buffers' twin and the conversions' twin construct models
whose parameters are on the meta device; initialising them computed nothing and cost a third of
`load_pretrained`'s time (benchmarks/results/peers.md). The guarantees: real tensors are still
initialised, buffers keep their constructed values, the weights later initialised equal
transformers' own, and no flag or patch outlives the construction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp2kit as fk
from fsdp2kit._internal.markers import HF_INITIALIZED
from fsdp2kit._internal.meta_init import skip_meta_parameter_init
from fsdp2kit.models import build_causal_lm

pytestmark = pytest.mark.timeout(120)


def test_torch_init_skips_meta_tensors_only(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", lambda t, *a, **k: seen.append(t.device.type) or t)
    with skip_meta_parameter_init():
        nn.Linear(4, 4, device="meta")
        nn.Linear(4, 4)  # a real tensor: still initialised
    assert seen == ["cpu"]
    nn.Linear(4, 4, device="meta")  # outside: torch's own behaviour again
    assert seen == ["cpu", "meta"]


def test_flags_are_removed_and_patches_undone():
    register, normal = nn.Module.register_parameter, torch.nn.init.normal_
    with skip_meta_parameter_init():
        inside = nn.Linear(4, 4, device="meta")
        assert getattr(inside.weight, HF_INITIALIZED, False)
    assert not hasattr(inside.weight, HF_INITIALIZED)
    assert nn.Module.register_parameter is register and torch.nn.init.normal_ is normal
    model = build_causal_lm("demo", meta=True)
    assert not [n for n, p in model.named_parameters() if hasattr(p, HF_INITIALIZED)]


def test_meta_build_then_init_equals_transformers_own_init(mesh):
    """A meta build initialises as transformers' own meta build does: by its init, or by materialize."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the reference: no fsdp2kit in its construction
        reference = AutoModelForCausalLM.from_config(build_causal_lm("demo", meta=True).config)
    reference.to_empty(device="cpu")
    torch.manual_seed(5)
    reference.initialize_weights()  # what transformers runs on a meta-built model's missing weights
    # transformers' own init after to_empty, as on a model it built on meta itself.
    ours = build_causal_lm("demo", meta=True)
    ours.to_empty(device="cpu")
    torch.manual_seed(5)
    ours.initialize_weights()
    for (name, p), (_, q) in zip(ours.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    buffers = dict(build_causal_lm("demo", meta=False).named_buffers())
    unsharded = build_causal_lm("demo", meta=True)  # materialize keeps these very Parameter objects
    sharded = build_causal_lm("demo", meta=True)
    fk.shard_model(sharded, mesh)
    for model in (unsharded, sharded):
        torch.manual_seed(5)
        fk.materialize(model, device="cpu")
        ours = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
        for name, p in reference.named_parameters():
            assert torch.equal(ours[name], p), name
        for name, b in model.named_buffers():  # rotary inv_freq: computed by construction, not skipped
            assert torch.equal(b, buffers[name]), name
