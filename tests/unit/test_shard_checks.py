"""Every bad input to make_mesh / shard_model fails before any collective, with a message that names it.

These run in a world of one inside the pytest process: pre-flight checks need no peers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from models import TinyGPT, build, lm_loss
from torch.distributed.device_mesh import init_device_mesh

import fsdp2kit as fk
from fsdp2kit.preflight import check_devices
from fsdp2kit.shard import resolve_strategy


def test_strategy_names_and_mesh_shapes(mesh):
    assert resolve_strategy(None, (4,)).name == "FULL_SHARD"
    assert resolve_strategy("shard_grad_op", (4,)).reshard_after_forward is False
    assert resolve_strategy(None, (2, 4)).name == "HYBRID_SHARD"
    assert resolve_strategy("HYBRID_SHARD_ZERO2", (2, 4)).reshard_after_forward is False
    with pytest.raises(ValueError, match="strategy='ZERO3': expected one of \\['FULL_SHARD'"):
        resolve_strategy("ZERO3", (4,))
    with pytest.raises(ValueError, match="HYBRID_SHARD needs a 2-D mesh but got a 1-D mesh.*replicate > 1"):
        resolve_strategy("HYBRID_SHARD", (4,))
    with pytest.raises(ValueError, match="FULL_SHARD needs a 1-D mesh but got a 2-D mesh"):
        resolve_strategy("FULL_SHARD", (2, 2))
    # and through shard_model, with a real 2-D mesh
    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="FULL_SHARD needs a 1-D mesh but got a 2-D mesh of shape \\(1, 1\\)"):
        fk.shard_model(TinyGPT(), mesh2d, strategy="FULL_SHARD")


def test_make_mesh_sizes(mesh):
    assert mesh.mesh_dim_names == ("shard",) and mesh.size() == 1
    with pytest.raises(
        ValueError,
        match=r"shard=2, replicate=1 does not fit the world size 1; sizes that work: \(shard=1, replicate=1\)",
    ):
        fk.make_mesh(shard=2)
    with pytest.raises(ValueError, match="at most one of shard and replicate may be -1"):
        fk.make_mesh(shard=-1, replicate=-1)
    with pytest.raises(ValueError, match="shard=0 must be a positive int or -1"):
        fk.make_mesh(shard=0)
    with pytest.raises(ValueError, match="replicate=True must be a positive int"):
        fk.make_mesh(replicate=True)


def test_init_distributed_twice_is_the_same_world(mesh):
    a, b = fk.init_distributed(), fk.init_distributed()
    assert a == b and a.world_size == 1 and a.rank == 0 and a.backend == "gloo"


def test_plan_table_on_meta_model(mesh):
    with torch.device("meta"):
        model = build("llama")
    plan = fk.shard_model(model, mesh)
    text = str(plan)
    assert "model.layers.0" in text and "model.embed_tokens" in text and "(root) LlamaForCausalLM" in text
    n = sum(p.numel() for p in model.parameters())
    assert plan.n_params == n and plan.param_bytes_per_rank == 4 * n
    assert plan.adam_bytes_per_rank == 8 * n and plan.grad_bytes_per_rank == 4 * n
    # the last block stays gathered into backward, the others reshard (default FULL_SHARD)
    assert [u.reshard_after_forward for u in plan.units[:3]] == [True, True, False]


def test_mixed_dtypes_in_a_unit(mesh):
    model = TinyGPT()
    model.trunk[1].fc1.half()  # a whole module of another dtype: sharded as a unit of its own
    plan = fk.shard_model(model, mesh)
    assert [u.name for u in plan.units].count("trunk.1 [float16 trainable: trunk.1.fc1]") == 1
    model = TinyGPT()
    fc1 = model.trunk[1].fc1
    fc1.weight.data = fc1.weight.data.half()  # one module holding two trainable dtypes: no unit can separate them
    with pytest.raises(ValueError, match=r"unit trunk.1 mixes trainable parameter dtypes.*trunk.1.fc1 \(trunk.1.fc1.b"):
        fk.shard_model(model, mesh)
    fc1.requires_grad_(False)  # frozen parameters may differ
    fk.shard_model(model, mesh)


def test_tied_across_blocks(mesh):
    model = TinyGPT()
    model.trunk[2].fc2.weight = model.trunk[0].fc2.weight
    with pytest.raises(
        ValueError,
        match=r"tied parameter shared by \['trunk.0.fc2', 'trunk.2.fc2'\] "
        r"would be split across FSDP units \['trunk.0', 'trunk.2'\]",
    ):
        fk.shard_model(model, mesh)


def test_block_tied_with_outside_module(mesh):
    model = TinyGPT(dim=40, vocab=40)
    model.trunk[0].proj.weight = model.tok.weight
    with pytest.raises(ValueError, match=r"split across FSDP units \['\(outside the blocks\)', 'trunk.0'\]"):
        fk.shard_model(model, mesh)


def test_already_sharded(mesh):
    model = TinyGPT()
    fk.shard_model(model, mesh)
    with pytest.raises(ValueError, match="is already sharded by fully_shard"):
        fk.shard_model(model, mesh)


def test_bad_options(mesh):
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        fk.shard_model(TinyGPT(), "cpu")
    with pytest.raises(ValueError, match="mixed_precision='int4'"):
        fk.shard_model(TinyGPT(), mesh, mixed_precision="int4")
    with pytest.raises(ValueError, match="reshard_after_forward=2: .*divide the shard size 1.*valid here: none"):
        fk.shard_model(TinyGPT(), mesh, reshard_after_forward=2)
    with pytest.raises(TypeError, match="reshard_after_forward must be None, a bool or an int"):
        fk.shard_model(TinyGPT(), mesh, reshard_after_forward="yes")


class _FakeMesh:
    device_type = "cuda"


def test_mesh_device_must_match_parameters():
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"parameters are on cpu \(e.g. pos\) but the mesh is a 'cuda' mesh"):
        check_devices(model, _FakeMesh(), cpu_offload=False)
    check_devices(model, _FakeMesh(), cpu_offload=True)  # offloaded parameters live on CPU by design
    with torch.device("meta"):
        check_devices(TinyGPT(), _FakeMesh(), cpu_offload=False)  # meta: materialised later


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_parameters_on_two_devices():
    model = TinyGPT()
    model.head.cuda()
    with pytest.raises(ValueError, match="parameters are on different devices"):
        check_devices(model, _FakeMesh(), cpu_offload=False)


def test_optimizer_built_before_sharding_is_refused(mesh):
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters())
    fk.shard_model(model, mesh)
    lm_loss(model, torch.randint(0, 96, (2, 8))).backward()
    with pytest.raises(
        RuntimeError,
        match=r"AdamW holds parameter 'pos' as it was before shard_model.*Build the optimizer after shard_model",
    ):
        opt.step()
    good = torch.optim.AdamW(model.parameters())
    good.step()  # the right order is not disturbed
    assert not good._optimizer_step_pre_hooks and len(opt._optimizer_step_pre_hooks) == 1
    # Found at the first forward, by the model's own one-off hook: nothing process-wide.
    assert not optimizer_module._global_optimizer_pre_hooks
    assert [type(h.__self__).__name__ for h in model._forward_pre_hooks.values()] == ["FSDPState"]  # ours is gone


def test_world_of_one_trains_like_plain_pytorch(mesh):
    ref = build("tinygpt")
    model = copy.deepcopy(ref)
    fk.shard_model(model, mesh)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    tokens = torch.randint(0, 96, (4, 9), generator=torch.Generator().manual_seed(0))
    for o, m in ((opt, model), (ref_opt, ref)):
        lm_loss(m, tokens).backward()
        o.step()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r, rtol=1e-6, atol=1e-7, msg=name)


def test_estimate_plan_matches_shard_model_without_a_mesh(mesh):
    with torch.device("meta"):
        a, b = build("llama"), build("llama")
    estimate = fk.estimate_plan(a, shard=1)
    assert str(estimate) == str(fk.shard_model(b, mesh))
    with torch.device("meta"):
        big = build("llama")
    hsdp = fk.estimate_plan(big, shard=3, replicate=2, mixed_precision="bf16")
    n = sum(p.numel() for p in big.parameters())
    assert hsdp.mesh_shape == (2, 3) and hsdp.strategy == "HYBRID_SHARD"
    assert n * 4 / 3 <= hsdp.param_bytes_per_rank < n * 4 / 3 + 4 * 3 * 200  # padding of uneven rows
    assert hsdp.units[0].bytes_gathered == sum(p.numel() for p in big.model.layers[0].parameters()) * 2  # bf16
    no_shard = fk.estimate_plan(big, shard=4, strategy="NO_SHARD")
    assert no_shard.mesh_shape == (4, 1) and no_shard.param_bytes_per_rank == n * 4
