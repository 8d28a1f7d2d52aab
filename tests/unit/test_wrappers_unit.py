"""The wrappers without a process group: argument checks, order checks, what they change and what they keep."""

from __future__ import annotations

import copy

import pytest
import torch
from models import TinyGPT, build, lm_loss
from wrappers_world import WRAPPERS  # the same wrapper set the multi-process tests use

import fsdp2kit as fk
from fsdp2kit.wrappers.activation import SELECTIVE_SAVE, resolve_ac_mode
from fsdp2kit.wrappers.forward import BlockForward

pytestmark = pytest.mark.timeout(120)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(seed))


# ---- argument checks ----


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("full", ("full", 1)),
        ("FULL", ("full", 1)),
        (1, ("full", 1)),
        (3, ("every", 3)),
        ("selective", ("selective", 1)),
        ("op", ("op", 1)),
    ],
)
def test_resolve_ac_mode(mode, expected) -> None:
    assert resolve_ac_mode(mode) == expected


@pytest.mark.parametrize("mode", ["fulll", "ops", 0, -2, True, 1.5, None, ["full"]])
def test_bad_ac_mode_raises_and_changes_nothing(mode) -> None:
    model = TinyGPT()
    with pytest.raises(ValueError, match="mode="):
        fk.apply_activation_checkpointing(model, mode)
    assert all("forward" not in b.__dict__ for b in model.trunk)


@pytest.mark.parametrize("forward,backward", [(-1, 1), (1, -1), (True, 1), (1.5, 1), (1, "2")])
def test_bad_prefetch_values(forward, backward) -> None:
    with pytest.raises(ValueError, match="expected an int >= 0"):
        fk.set_prefetch(TinyGPT(), forward=forward, backward=backward)


def test_prefetch_before_shard_model_raises() -> None:
    with pytest.raises(ValueError, match="after shard_model"):
        fk.set_prefetch(TinyGPT())


def test_compile_rejects_unknown_arguments() -> None:
    with pytest.raises(ValueError, match="unknown torch.compile arguments"):
        fk.compile_blocks(TinyGPT(), fullgraf=True)


def test_compile_warns_about_hf_kv_cache_in_training() -> None:
    with pytest.warns(UserWarning, match="use_cache"):
        fk.compile_blocks(build("llama"))


def test_float8_rejects_non_bool() -> None:
    with pytest.raises(ValueError, match="fsdp_all_gather"):
        fk.enable_float8(build("tinygpt-f8"), fsdp_all_gather="yes")


# ---- order checks: float8 -> AC -> compile -> shard_model ----


def test_each_wrapper_once() -> None:
    model = fk.compile_blocks(fk.apply_activation_checkpointing(fk.enable_float8(build("tinygpt-f8")), 2))
    with pytest.raises(ValueError, match="call it once"):
        fk.enable_float8(model)
    with pytest.raises(ValueError, match="before compile_blocks"):
        fk.apply_activation_checkpointing(model, 2)
    with pytest.raises(ValueError, match="call it once"):
        fk.compile_blocks(model)
    ac_only = fk.apply_activation_checkpointing(TinyGPT(), "full")
    with pytest.raises(ValueError, match="already applied"):
        fk.apply_activation_checkpointing(ac_only, "selective")


def test_float8_after_ac_or_compile_raises() -> None:
    for wrap in (lambda m: fk.apply_activation_checkpointing(m, "full"), lambda m: fk.compile_blocks(m)):
        model = wrap(build("tinygpt-f8"))
        with pytest.raises(ValueError, match="enable_float8 must be called before"):
            fk.enable_float8(model)


def test_foreign_forward_replacement_is_refused() -> None:
    model = TinyGPT()
    model.trunk[1].forward = lambda x: x
    with pytest.raises(ValueError, match="did not install"):
        fk.apply_activation_checkpointing(model, "full")


# ---- float8: which layers ----


def test_float8_converts_block_linears_and_skips_the_head() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = fk.enable_float8(build("llama-f8"))
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(converted) == 3 * 7  # q, k, v, o, gate, up, down per block
    assert "lm_head" not in converted
    tiny = fk.enable_float8(build("tinygpt-f8"), filter_fn=lambda m, name: not name.endswith("fc2"))
    converted = {n for n, m in tiny.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"trunk.{i}.{n}" for i in range(3) for n in ("qkv", "proj", "fc1")}  # head 32->96 stays


def test_float8_without_eligible_layers_raises() -> None:
    # hidden 40, intermediate 56: no Linear has both dimensions divisible by 16
    with pytest.raises(ValueError, match="no Linear layer is eligible"):
        fk.enable_float8(build("llama"))


# ---- what every wrapper keeps: names, blocks; and what AC computes ----


@pytest.mark.parametrize("kind", ["llama-f8", "tinygpt-f8"])
def test_names_and_blocks_unchanged(kind: str) -> None:
    plain = build(kind)
    blocks = [n for n, m in plain.named_modules() if any(m is b for b in fk.find_blocks(plain))]
    for name, wrap in WRAPPERS.items():
        model = build(kind)
        if hasattr(model, "config"):
            model.config.use_cache = False
        wrap(model)
        assert list(model.state_dict()) == list(plain.state_dict()), name
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()], name
        found = fk.find_blocks(model)
        assert [n for n, m in model.named_modules() if any(m is b for b in found)] == blocks, name


@pytest.mark.parametrize("kind", ["tinygpt", "llama"])
@pytest.mark.parametrize("mode", ["full", 2, "selective"])
def test_ac_gives_the_same_gradients(kind: str, mode) -> None:
    plain, model = build(kind), build(kind)
    fk.apply_activation_checkpointing(model, mode)
    lm_loss(plain, _tokens()).backward()
    lm_loss(model, _tokens()).backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_ac_every_n_marks_blocks_0_n_2n() -> None:
    model = fk.apply_activation_checkpointing(TinyGPT(depth=5), 2)
    assert ["forward" in b.__dict__ for b in model.trunk] == [True, False, True, False, True]


def test_ac_on_hf_layers_uses_their_switch() -> None:
    model = fk.apply_activation_checkpointing(build("llama"), "full")
    for layer in model.model.layers:
        assert layer.gradient_checkpointing and "forward" not in layer.__dict__
    # the KV cache (on by default) is not updated twice: a training forward runs
    model.train()
    lm_loss(model, _tokens()).backward()


def test_ac_forward_outside_training() -> None:
    plain = TinyGPT()
    model = fk.apply_activation_checkpointing(copy.deepcopy(plain), "full")
    with torch.no_grad():
        assert torch.equal(model(_tokens()[:, :-1]), plain(_tokens()[:, :-1]))
    model.eval()
    assert torch.equal(model(_tokens()[:, :-1]), plain.eval()(_tokens()[:, :-1]))


def test_deepcopy_of_wrapped_model_runs_on_the_copy() -> None:
    model = fk.apply_activation_checkpointing(TinyGPT(), "full")
    clone = copy.deepcopy(model)
    for block in clone.trunk:
        assert isinstance(block.forward, BlockForward) and block.forward.module is block
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    assert not torch.equal(clone(_tokens()[:, :-1]), model(_tokens()[:, :-1]))


def test_selective_policy_saves_matmuls_and_attention() -> None:
    aten = torch.ops.aten
    for op in (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ):
        assert op in SELECTIVE_SAVE
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.add.Tensor, aten.mul.Tensor):
        assert op not in SELECTIVE_SAVE


def test_op_policy_saves_attention_and_every_other_matmul() -> None:
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from fsdp2kit.wrappers.activation import op_policy

    aten = torch.ops.aten
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    ops = [
        aten.mm.default,
        aten.mm.default,
        aten.addmm.default,
        sdpa,
        aten.mul.Tensor,
        aten.mm.default,
        aten.max.default,
    ]
    expected = [save, recompute, save, save, recompute, recompute, save]
    policy = op_policy({})
    forward, again = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    assert [policy(forward, op) for op in ops] == expected
    # the recompute numbers its matmuls from 1 again, so it recomputes exactly what the forward did not keep
    assert [policy(again, op) for op in ops] == expected
