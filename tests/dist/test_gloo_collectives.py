"""fsdp2kit's gloo reduce-scatter and all-gather: the same numbers as gloo's own, and the same training.

One spawn per world size (2, 3 with uneven shards, 2x2 HSDP) runs every check:
- the collectives against ``dist.reduce_scatter_single`` / ``all_gather_single`` on the
  same inputs (SUM, AVG, bf16, uint8, async, the fall-backs);
- sharded training with them (``collectives="auto"``, the default) against the same training with
  FSDP2's own (``"torch"``) and against the single-process reference of tests/dist/parity.py;
- that shard_model puts them on every unit, and only when asked;
- shard_model's step defaults: the forward prefetch chain on gloo, no embedding re-gather in backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parity import Case, run_case

from fsdp2kit.collectives import GlooAllGather, GlooReduceScatter, resolve_collectives
from fsdp2kit.testing import run_world

RTOL = 1e-5  # against the single-process reference, as in test_parity.py
SAME_RTOL = 1e-6  # against FSDP2's own collectives (bitwise wherever a shard group has 2 ranks)

CASES = [
    Case(model="tinygpt", optim="adamw"),
    Case(model="tinygpt-tied", strategy="SHARD_GRAD_OP", optim="sgd", accum=2, clip=0.3),
]


def _groups(world: int) -> list[dist.ProcessGroup]:
    """The groups the collectives run on: the world, and at 4 ranks the 2x2 mesh's shard group."""
    if world != 4:
        return [dist.group.WORLD]
    import fsdp2kit as fk

    return [dist.group.WORLD, fk.make_mesh(shard=2, replicate=2).get_group("shard")]


def _compare_collectives(world: int) -> list[tuple[str, int, bool, float]]:
    """(check, group size, bitwise equal, max abs difference) of fsdp2kit's collectives against gloo's."""
    rank = dist.get_rank()
    out = []
    rs, ag, blocking = GlooReduceScatter(), GlooAllGather(), GlooAllGather(always_async=False)
    for group in _groups(world):
        n, me = group.size(), group.rank()
        where = f"group of {n}"
        for dtype, op in (
            (torch.float32, dist.ReduceOp.SUM),
            (torch.float32, dist.ReduceOp.AVG),
            (torch.bfloat16, dist.ReduceOp.AVG),
        ):
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(n * 1001, generator=gen).to(dtype)
            want = torch.empty(1001, dtype=dtype)
            dist.reduce_scatter_single(want, x.clone(), op=op, group=group)
            got = rs.allocate((1001,), dtype=dtype, device=torch.device("cpu"))
            assert rs(got, x, group, op) is None
            diff = (got.float() - want.float()).abs().max().item()
            out.append((f"reduce-scatter {dtype} {op} {where}", n, torch.equal(got, want), diff))
        # async (FSDP2 never asks) goes to gloo's own reduce-scatter and returns its Work
        x = torch.randn(n * 7, generator=torch.Generator().manual_seed(rank))
        got, want = torch.empty(7), torch.empty(7)
        rs(got, x, group, dist.ReduceOp.SUM, async_op=True).wait()
        dist.reduce_scatter_single(want, x, group=group)
        out.append((f"reduce-scatter async fall-back {where}", n, torch.equal(got, want), 0.0))

        for dtype in (torch.float32, torch.uint8):
            shard = (torch.arange(13) + 100 * me).to(dtype)
            want = torch.empty(n * 13, dtype=dtype)
            dist.all_gather_single(want, shard, group=group)
            for gather, async_op in ((ag, False), (ag, True), (blocking, False), (blocking, True)):
                got = torch.zeros(n * 13, dtype=dtype)
                inp = got[me * 13 : (me + 1) * 13]  # FSDP2's layout: the input lives inside the output
                inp.copy_(shard)
                work = gather(got, inp, group, async_op=async_op)
                if async_op or gather.always_async:  # the default: a Work even when not asked
                    assert isinstance(work, dist.Work)
                    work.wait()
                else:
                    assert work is None
                label = f"all-gather {dtype} async={async_op} always_async={gather.always_async} {where}"
                out.append((label, n, torch.equal(got, want), 0.0))
            got = torch.zeros(n * 13, dtype=dtype)  # an input outside the output is copied in
            ag(got, shard, group).wait()
            out.append((f"all-gather separate input {dtype} {where}", n, torch.equal(got, want), 0.0))
    return out


def _comm_types(model) -> set[tuple[str, str]]:
    from torch.distributed.fsdp import FSDPModule

    kinds = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                kinds.add((type(group._reduce_scatter_comm).__name__, type(group._all_gather_comm).__name__))
    return kinds


def _step_settings(model) -> dict[str, tuple[bool, list[str]]]:
    """Per FSDP unit (by module name): whether it is all-gathered in backward, and which units it
    prefetches in forward."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n or "(root)" for n, m in model.named_modules()}
    out = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            targets = [names[id(s._modules[0])] for s in state._states_to_forward_prefetch]
            out[names[id(module)]] = (state._fsdp_param_group.unshard_in_backward, targets)
    return out


def _world(world: int) -> dict:
    from dataclasses import replace

    results = []
    for case in CASES:
        case = replace(case, keep_params=True)
        if world == 4:  # the same cases as HSDP on a 2x2 mesh
            hybrid = "HYBRID_SHARD_ZERO2" if case.strategy == "SHARD_GRAD_OP" else "HYBRID_SHARD"
            case = replace(case, shard=2, replicate=2, strategy=hybrid)
        pair = (run_case(case), run_case(replace(case, collectives="torch")))
        for res in pair:  # tensors do not survive the trip back from a rank that exits: numpy does
            res["params"] = {n: t.numpy() for n, t in res["params"].items()} if dist.get_rank() == 0 else {}
        results.append(pair)

    from models import build

    import fsdp2kit as fk

    mesh = fk.make_mesh(shard=2, replicate=2) if world == 4 else fk.make_mesh()
    installed, settings = {}, {}
    for collectives in ("auto", "torch"):
        model = build("tinygpt")
        fk.shard_model(model, mesh, collectives=collectives)
        installed[collectives] = sorted(_comm_types(model))
        settings[collectives] = _step_settings(model)
    model = build("tinygpt-tied")
    fk.shard_model(model, mesh)
    settings["tied"] = _step_settings(model)
    return {
        "comms": _compare_collectives(world),
        "training": results,
        "installed": installed,
        "settings": settings,
    }


_results: dict[int, list[dict]] = {}


def _ranks(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_world(_world, world, world, timeout=300)
    return _results[world]


WORLDS = [pytest.param(2, id="w2"), pytest.param(3, id="w3-uneven"), pytest.param(4, id="w2x2-hsdp")]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("world", WORLDS)
def test_collectives_match_gloo(world: int) -> None:
    for rank, res in enumerate(_ranks(world)):
        for check, n, bitwise, diff in res["comms"]:
            if n > 2 and check.startswith("reduce-scatter") and "async" not in check:
                # three or more contributions are summed in rank order, gloo's ring adds them in
                # another order (and in bf16 at each addition, where the local sum accumulates in
                # fp32 and rounds once): a rounding apart, inputs are N(0, 1)
                tol = 0.05 if "bfloat16" in check else 1e-5
                assert diff <= tol, f"rank {rank}: {check} differs by {diff}"
            else:
                assert bitwise, f"rank {rank}: {check} is not bitwise gloo's result (max diff {diff})"


@pytest.mark.timeout(330)
@pytest.mark.parametrize("world", WORLDS)
def test_training_matches_torch_collectives_and_reference(world: int, parity_table) -> None:
    ranks = _ranks(world)
    for ours, theirs in ranks[0]["training"]:
        parity_table.append((ours["label"], world, ours["worst_rel"], ours["worst_param"]))
        assert ours["worst_rel"] < RTOL, f"{ours['label']}: {ours['worst_param']} off by {ours['worst_rel']:.2e}"
        assert ours["losses"] == pytest.approx(ours["ref_losses"], rel=RTOL)
        shard_group = 2 if world in (2, 4) else world
        for name, p in ours["params"].items():
            p, q = torch.as_tensor(p), torch.as_tensor(theirs["params"][name])
            if shard_group == 2:
                assert torch.equal(p, q), f"{ours['label']}: {name} is not bitwise FSDP2's own result"
            else:
                rel = ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
                assert rel < SAME_RTOL, f"{ours['label']}: {name} differs from FSDP2's own by {rel:.1e}"
    for other in ranks[1:]:
        assert [o["losses"] for o, _ in other["training"]] == [o["losses"] for o, _ in ranks[0]["training"]]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("world", WORLDS)
def test_shard_model_installs_them_on_gloo(world: int) -> None:
    installed = _ranks(world)[0]["installed"]
    assert installed["auto"] == [("GlooReduceScatter", "GlooAllGather")]  # every unit
    assert installed["torch"] == [("DefaultReduceScatter", "DefaultAllGather")]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("world", WORLDS)
def test_shard_model_step_defaults(world: int) -> None:
    """An untied embedding is not re-gathered in backward (any backend); on gloo every unit
    prefetches the next in forward: root, embedding, then the blocks in order."""
    settings = _ranks(world)[0]["settings"]
    blocks = [f"trunk.{i}" for i in range(3)]
    assert settings["auto"] == {
        "(root)": (True, ["tok"]),
        "tok": (False, ["trunk.0"]),
        "trunk.0": (True, ["trunk.1"]),
        "trunk.1": (True, ["trunk.2"]),
        "trunk.2": (True, []),
    }
    assert settings["torch"] == {"(root)": (True, []), "tok": (False, []), **{b: (True, []) for b in blocks}}
    # tied to the head, the table is read by the head's backward: it is gathered as before
    assert settings["tied"]["tok"] == (True, ["trunk.0"])
    assert settings["tied"]["(root)"] == (True, ["tok"])


def test_unknown_collectives_name() -> None:
    assert resolve_collectives("torch") == "torch"
    with pytest.raises(ValueError, match="collectives='nccl'"):
        resolve_collectives("nccl")
