"""Every `make_optimizer` choice on FSDP2's DTensor shards at world 2 (tests/dist/optim_world.py).

Parity: the sharded run against one process on the concatenated batch, same optimizer, same init.
The weights' shards are block-aligned (see optim_world.py), so the low-bit states quantize the
same blocks as the single process and agree as closely as fp32 AdamW does, except FP8's: its
3-bit mantissa puts a code boundary within fp32 rounding of some values, and a flipped code
moves that element's update by up to lr x 2^-3 (measured 1.1e-3 at lr 1e-2; every other element
agrees). Stochastic rounding draws other random numbers when the shapes differ, so adamw_bf16sr
is held to its own noise: the single-process run with its batch rows permuted and other draws.

Resume: saved at world 2 after 2 steps, loaded into a fresh model (another init) on the same
mesh and on a 2 x 1 HSDP mesh (every rank the whole tensor, as one process has it); the next 2
steps must equal the uninterrupted run's.

Mesh independence (pytorch/ao#4912): the same 3 steps on the same global batches at world 1, 2
and 3 leave the same optimizer state. Before make_optimizer chose blocks from the global shape,
world 3's 43-row shards of a 128 x 128 weight (5504 elements, not a multiple of 256) kept fp32
state where worlds 1 and 2 kept 8-bit. Now the classes and blocks must be equal on every world,
and the dequantized states equal up to the gradients' fp32 rounding: for a quantized state that
rounding can flip an element's code (measured on this test's data: the largest difference 0.57% of
the state's largest value for 8-bit, 0.29% for FP8, 4-bit's within fp32 rounding; the mean under
1.7e-6 of it), so the bound is 1/32 of the largest value and a mean of 1e-4 of it (a state kept at
another precision misses both); fp32 AdamW's states agree within 1e-4 of the largest value.
World 3 runs 8-bit in the default tier (its own spawn compiles torchao's step for its shapes),
4-bit and FP8 in the slow one.
"""

from __future__ import annotations

import pytest

from fsdp2kit.optim import OPTIMIZERS
from fsdp2kit.testing import run_world

QUANTIZED = {"adamw8bit": "OptimState8bit", "adamw4bit": "OptimState4bit", "adamw_fp8": "OptimStateFp8"}


W3 = ("adamw8bit",)  # world 3 in the default tier (a spawn compiles torchao's step for its shapes); the rest: slow


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("optim"))


@pytest.fixture(scope="module")
def world2(root):
    from optim_world import run_cases

    # A cold torch.compile cache compiles torchao's step per shape on both ranks: minutes, once.
    return run_world(run_cases, 2, root, OPTIMIZERS, timeout=540)


@pytest.fixture(scope="module")
def world3(world2, root):  # loads what world 2 saved
    from optim_world import world3_cases

    return run_world(world3_cases, 3, root, W3, W3, timeout=540)[0]


@pytest.mark.timeout(600)
def test_parity_with_one_process(world2):
    from optim_world import LR

    for r in world2:
        for name in OPTIMIZERS:
            p = r[name]["parity"]
            assert p["start_diff"] == 0.0 and p["moved"] > 0.01, (name, p)  # same init; the weights really moved
            if name in QUANTIZED:
                assert p["state_types"] == [QUANTIZED[name], "Tensor"], (name, p)  # weights quantized, biases not
            if name == "adamw_fp8":
                assert p["param_diff"] <= LR * 2**-3 and p["param_mean_diff"] < 1e-6, p
                assert p["loss_diff"] < 1e-4, p
            elif name == "adamw_bf16sr":
                assert p["param_dtype"] == "torch.bfloat16" and p["state_types"] == ["Tensor"], p
                noise = p["noise"]
                assert p["param_diff"] <= 2 * noise["max"] and p["param_mean_diff"] <= 2 * noise["mean"], p
                assert p["loss_diff"] < 2e-3, p
            else:  # adamw, adamw8bit, adamw4bit: fp32 rounding only
                assert p["param_diff"] < 1e-5 and p["loss_diff"] < 1e-5, (name, p)


@pytest.mark.timeout(600)
def test_checkpoint_resumes_and_reshards(world2):
    for r in world2:
        for name in OPTIMIZERS:
            res = r[name]["resume"]
            assert res["same_mesh"]["local_numel"] == 8192 and res["replicated"]["local_numel"] == 16384
            assert res["same_mesh"]["loss_diff"] == res["same_mesh"]["param_diff"] == 0.0, (name, res)
            if name == "adamw_bf16sr":  # other shapes draw other rounding noise after the load
                assert res["replicated"]["param_diff"] <= 2 * r[name]["parity"]["noise"]["max"], res
            else:
                assert res["replicated"]["loss_diff"] == res["replicated"]["param_diff"] == 0.0, (name, res)


@pytest.mark.timeout(600)
def test_refusals_and_warnings(world2):
    for r in world2:
        e = r["errors"]
        assert e["unknown"].startswith("ValueError") and all(n in e["unknown"] for n in OPTIMIZERS), e
        assert e["bf16sr_fp32"].startswith("ValueError") and "pure_bf16" in e["bf16sr_fp32"], e
        assert e["offload"].startswith("ValueError") and "not on a CUDA device" in e["offload"], e
        assert e["offload_low_bit"].startswith("ValueError") and "for 'adamw'" in e["offload_low_bit"], e
        assert e["trainable_only"] == 2  # the head's weight and bias: frozen blocks keep no state
        # 3200-element shards, quantized because the whole weights are, in blocks that divide their rows
        odd = r["odd_rows"]["adamw8bit"]["weights"]
        assert odd == [("OptimState8bit", 160, 3200), ("OptimState8bit", 40, 3200)], odd


@pytest.mark.timeout(600)
def test_planner_sizes_state_and_step_as_the_optimizer_does(world2):
    """The planner's state bytes (`rank_shards` -> `optimizer_bytes`, as plan_memory calls them) equal
    the allocation on weights whose 3200-element shards torchao's own rule keeps in fp32, and its step
    temporaries the bytes the step allocated above its state (the parity runs' last step)."""
    from optim_world import Net, odd_model

    from fsdp2kit.planner.parts import optimizer_bytes, rank_shards
    from fsdp2kit.precision import resolve_precision

    for r in world2:
        odd = rank_shards(odd_model(), 2, resolve_precision(None))
        for name in QUANTIZED:
            assert optimizer_bytes(odd, name).state == r["odd_rows"][name]["bytes"], name
        for name in OPTIMIZERS:
            mp = "pure_bf16" if name == "adamw_bf16sr" else None
            temp = optimizer_bytes(rank_shards(Net(), 2, resolve_precision(mp)), name, implementation="for-loop")
            measured = r[name]["parity"]["step_rise"]
            assert abs(temp.temporaries - measured) <= 0.02 * measured + 64, (name, temp.temporaries, measured)


def test_offloaded_adamw_steps_and_checkpoints_like_adamw(world2):
    """OffloadedAdamW on CPU ranks (its CUDA placement: tests/cuda): the same update as torch's AdamW up to
    fp32 rounding (its host step is torch's fused kernel, torch's AdamW on CPU the single-tensor one: a few
    ulps of O(1) parameters, 2.4e-7 measured), and its checkpoint continues in either optimizer."""
    for r in world2:
        o = r["offloaded"]
        assert o["param_diff"] <= 1e-6 and o["state_device"] == "cpu", o
        assert o["into_adamw_2x1"] <= 1e-6 and o["into_offloaded"] == 0.0, o
        assert o["fused_on_a_cpu_mesh"] is None, o


def test_offloaded_adamw_sees_every_change_between_backward_and_step(world2):
    """OffloadedAdamW copies the shards in step(), so what happens to the gradients between backward and step
    (either clip_grad_norm_, no_sync accumulation, a second backward) is in its update, as in torch's AdamW.
    Copies started from the post-accumulate-grad hook could not be trusted here: torch's foreach clip scales
    DTensor gradients without moving a version counter (docs/optimizers.md, "Offload")."""
    for r in world2:
        o = r["offloaded"]["between"]
        for mode, case in o.items():
            assert case["diff"] <= 1e-6, (mode, case)
        assert min(o["clip"]["norms"] + o["foreach_clip"]["norms"]) > 0.05, o  # both did scale


def _state_agrees(a: dict, b: dict, quantized: bool) -> tuple[bool, str]:
    import numpy as np

    if (a["type"], a["block"]) != (b["type"], b["block"]):
        return False, f"{a['type']} block {a['block']} vs {b['type']} block {b['block']}"
    scale = float(np.abs(a["value"]).max())
    diff = np.abs(a["value"] - b["value"])
    if not quantized or a["type"] == "Tensor":
        return bool(diff.max() <= 1e-4 * scale), f"max diff {diff.max():.3g} of {scale:.3g}"
    mean = float(diff.mean())
    why = f"max {diff.max():.3g}, mean {mean:.3g} of {scale:.3g}"
    return bool(diff.max() <= scale / 32 and mean <= 1e-4 * scale), why


def test_state_under_tp_shard1_is_the_one_process_state(world2):
    """A row-wise TP weight (Shard(1)) whose local row is a multiple of the block: every block of a local row is
    a block of the whole row, so tp=2's state is one process's (4-bit: within fp32 rounding, as at world 2)."""
    tp = world2[0]["tp"]
    assert "(Shard(dim=1),)" in tp["tp_placements"] and not tp["one_placements"], tp["tp_placements"]
    assert tp["tp"]["0.weight.exp_avg"]["type"] == "OptimState4bit", tp["tp"]["0.weight.exp_avg"]["type"]
    for key, one in tp["one"].items():
        ok, why = _state_agrees(tp["tp"][key], one, quantized=True)
        assert ok, (key, why)


@pytest.mark.timeout(600)
def test_state_is_the_same_on_every_mesh(world2, world3):
    mesh = world2[0]["mesh"]
    for name, states in mesh["one"].items():
        for key, one in ((k, v) for k, v in states.items() if not k.endswith(".param")):  # parity checks those
            if name in QUANTIZED and key.endswith("weight.exp_avg"):
                assert (one["type"], one["block"]) == (QUANTIZED[name], 128), (name, key)  # rows of 128
            worlds = {"2": mesh["world"][name][key], "3": world3["mesh"].get(name, {}).get(key)}
            for world, other in ((w, o) for w, o in worlds.items() if o is not None):
                ok, why = _state_agrees(one, other, name in QUANTIZED)
                assert ok, f"{name} {key}: world 1 vs {world}: {why}"


def _same(saved: dict, loaded: dict, what: str) -> None:
    """A state or parameter loaded on another mesh is the one saved: same class and block, and the
    values (a low-bit state is stored dequantized and quantized again in the same blocks) equal."""
    import numpy as np

    for key, a in saved.items():
        b = loaded[key]
        assert (a["type"], a["block"]) == (b["type"], b["block"]), (what, key, a["type"], b["type"])
        diff = float(np.abs(a["value"] - b["value"]).max())
        assert diff <= 1e-6 * float(np.abs(a["value"]).max()), (what, key, diff)


@pytest.mark.timeout(600)
def test_reshard_2_to_3(world2, world3):
    for name in W3:
        _same(world2[0][name]["resume"]["saved"], world3["hop"][name], f"{name} 2 -> 3")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_optimizer_on_every_mesh_and_reshard_chain(world2, world3, root, tmp_path):
    """World 3's states for 4-bit and FP8 too; 2 -> 3 -> 1 for every optimizer (the default tier has
    8-bit's 2 -> 3); and 2 x 2 HSDP -> 4 for all."""
    from optim_world import hsdp_to_flat, reshard_hop, world3_cases

    rest = tuple(n for n in OPTIMIZERS if n not in W3)
    more = run_world(world3_cases, 3, root, ("adamw4bit", "adamw_fp8"), rest, timeout=600)[0]
    one = world2[0]["mesh"]["one"]
    for name, states in more["mesh"].items():
        for key, other in states.items():
            if not key.endswith(".param"):
                ok, why = _state_agrees(one[name][key], other, name in QUANTIZED)
                assert ok, f"{name} {key}: world 1 vs 3: {why}"
    hop3 = {**world3["hop"], **more["hop"]}
    world1 = run_world(reshard_hop, 1, f"{root}/w3", None, OPTIMIZERS, timeout=300)[0]
    for name in OPTIMIZERS:
        _same(world2[0][name]["resume"]["saved"], hop3[name], f"{name} 2 -> 3")
        _same(hop3[name], world1[name], f"{name} 3 -> 1")
    world4 = run_world(hsdp_to_flat, 4, str(tmp_path), OPTIMIZERS, timeout=600)[0]
    for name in OPTIMIZERS:
        _same(world4["saved"][name], world4["loaded"][name], f"{name} 2x2 -> 4")
