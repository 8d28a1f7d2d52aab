"""What each rank runs for test_wrappers: parity cases, memory, state-dict keys, float8 scales, order errors.

Everything runs inside one `run_world` spawn per world size (process start-up is the slow part);
each check returns plain data and the test module asserts on it, so a failure names the check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from models import TinyGPT, build, lm_loss
from parity import Case, _mesh, _optimizer, run_case
from torch.distributed.checkpoint.state_dict import get_state_dict

import fsdp2kit as fk

WRAPPERS = {
    "plain": lambda m: None,
    "AC full": lambda m: fk.apply_activation_checkpointing(m, "full"),
    "AC 2": lambda m: fk.apply_activation_checkpointing(m, 2),
    "AC selective": lambda m: fk.apply_activation_checkpointing(m, "selective"),
    "compile": lambda m: fk.compile_blocks(m),
    "AC+compile": lambda m: fk.compile_blocks(fk.apply_activation_checkpointing(m, "selective")),
    "float8": lambda m: fk.enable_float8(m),
    "float8+AC+compile": lambda m: fk.compile_blocks(fk.apply_activation_checkpointing(fk.enable_float8(m), 2)),
}


def _wrapped(kind: str, wrapper: str):
    model = build(kind)
    if hasattr(model, "config"):
        model.config.use_cache = False
    WRAPPERS[wrapper](model)
    return model


def state_dict_keys(kind: str, wrappers: list[str]) -> dict:
    """Per wrapper: state-dict keys, DCP (model + optimizer) keys and the FSDP units, after shard_model."""
    out = {}
    for wrapper in wrappers:
        model = _wrapped(kind, wrapper)
        plan = fk.shard_model(model, _mesh(-1, 1))
        fk.set_prefetch(model, 1, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # One step so the optimizer has state: its keys are parameter names too. Compile is lazy
        # and costly on CPU, so the compiled variants skip the step (their names cannot change
        # at run time: only forward is replaced).
        if "compile" not in wrapper:
            lm_loss(model, torch.randint(0, 96, (2, 9))).backward()
            opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        out[wrapper] = {
            "state_dict": sorted(model.state_dict()),
            "params": [n for n, _ in model.named_parameters()],
            "dcp_model": sorted(model_sd),
            "dcp_optim": sorted(optim_sd["state"]),
            "units": [(u.name, u.n_params) for u in plan.units],
        }
    return out


def ac_memory(modes: list, kind: str = "tinygpt") -> dict:
    """Peak memory per rank (FSDPMemTracker: every tensor storage a dispatched op creates, by category).

    The tracker is a TorchDispatchMode, under which compiled regions run eagerly: it measures
    eager memory only (the benchmark measures compiled variants by peak RSS instead).
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        # Activations must dominate for AC to matter: a long sequence, a narrow model.
        if kind == "tinygpt":
            model = TinyGPT(dim=64, depth=4, heads=4, seq=128)
        else:  # transformers layers: checkpointed through their own switch
            model = build(kind)
            model.config.use_cache = False
        if mode is not None:
            fk.apply_activation_checkpointing(model, mode)
        fk.shard_model(model, _mesh(-1, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 96, (4 * world, 129), generator=torch.Generator().manual_seed(5))
        local = tokens[rank * 4 : (rank + 1) * 4]
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((local,))
        with tracker:
            for step in range(2):  # the second step has optimizer state, like every later one
                lm_loss(model, local).backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()  # per-module stats; the overall peak is kept
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        by_kind = {str(k.value) if hasattr(k, "value") else str(k): v for k, v in peak.items()}
        out[str(mode)] = by_kind
    return out


def float8_scales() -> dict:
    """The float8 weight scales are refreshed after each optimizer step, and only then."""
    from torchao.float8.float8_linear import Float8Linear

    rank, world = dist.get_rank(), dist.get_world_size()
    model = fk.enable_float8(build("llama-f8"))
    fk.shard_model(model, _mesh(-1, 1))
    opt = _optimizer("adamw", model.parameters())
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    gen = torch.Generator().manual_seed(3)
    max_e4m3 = torch.finfo(torch.float8_e4m3fn).max
    worst, refreshed, kept = 0.0, [], []
    previous = None
    for _ in range(3):
        tokens = torch.randint(0, 96, (2 * world, 13), generator=gen)[rank * 2 : (rank + 1) * 2]
        lm_loss(model, tokens).backward()  # its forward refreshed the scales if the weights changed
        scales = [layer.weight._local_tensor._precomputed_scale for layer in layers]
        for layer, scale in zip(layers, scales):
            fresh = (max_e4m3 / layer.weight.full_tensor().abs().max().double()).float()
            worst = max(worst, ((scale - fresh).abs() / fresh).item())
        if previous is not None:
            refreshed.append(all(a is not b for a, b in zip(scales, previous)))
        # a second forward and backward without an optimizer step (a gradient-accumulation micro-step)
        lm_loss(model, tokens).backward()
        kept.append(all(a is layer.weight._local_tensor._precomputed_scale for a, layer in zip(scales, layers)))
        opt.step()
        opt.zero_grad()
        previous = scales
    return {"n_layers": len(layers), "worst_scale_rel": worst, "refreshed": refreshed, "kept": kept}


_GRAPHS: list[bool] = []


def recording_backend(gm, example_inputs):
    """A torch.compile backend that notes whether each graph holds a checkpointed region, then runs it eagerly."""
    _GRAPHS.append(any("checkpoint" in str(node.target) for node in gm.graph.nodes if node.op == "call_function"))
    return gm.forward


def compiled_regions() -> dict:
    """What dynamo traced for each block after shard_model: checkpointed blocks must carry the checkpoint.

    Activation checkpointing does not change numbers, so parity cannot tell whether it ran; the
    traced graphs can. (A forward captured before fully_shard swaps the block's class would make
    transformers' layers skip their checkpoint without a word.)
    """
    out = {}
    for kind in ("llama", "tinygpt"):
        model = build(kind)
        if hasattr(model, "config"):
            model.config.use_cache = False
        fk.compile_blocks(fk.apply_activation_checkpointing(model, 2), backend=recording_backend)
        fk.shard_model(model, _mesh(-1, 1))
        _GRAPHS.clear()
        lm_loss(model, torch.randint(0, 96, (2, 9))).backward()
        out[kind] = list(_GRAPHS)
    return out


def prefetch_targets() -> dict:
    """Which blocks each block prefetches, and the prefetch events a training step records."""
    from torch.profiler import ProfilerActivity, profile

    model = build("tinygpt")
    fk.shard_model(model, _mesh(-1, 1))
    blocks = list(model.trunk)
    index = {id(b._get_fsdp_state()): i for i, b in enumerate(blocks)}
    out = {}
    for forward, backward in ((2, 1), (0, 0)):
        fk.set_prefetch(model, forward, backward)
        states = [b._get_fsdp_state() for b in blocks]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            lm_loss(model, torch.randint(0, 96, (2, 9))).backward()
        names = [e.name for e in prof.events()]
        out[f"{forward}/{backward}"] = {
            "forward": [[index[id(t)] for t in s._states_to_forward_prefetch] for s in states],
            "backward": [[index[id(t)] for t in s._states_to_backward_prefetch] for s in states],
            "forward_events": sum(n.startswith("FSDP::forward_prefetch") for n in names),
            "backward_events": sum(n.startswith("FSDP::backward_prefetch") for n in names),
        }
    return out


def unshard_in_backward() -> dict:
    """Per FSDP unit of shard_model's defaults (untied and tied head): whether backward gathers it again."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for kind in ("tinygpt", "tinygpt-tied"):
        model = build(kind)
        fk.shard_model(model, _mesh(-1, 1))
        names = {id(m): n or "(root)" for n, m in model.named_modules()}
        out[kind] = {
            names[id(m)]: m._get_fsdp_state()._fsdp_param_group.unshard_in_backward
            for m in model.modules()
            if isinstance(m, FSDPModule)
        }
    return out


def order_errors() -> dict:
    """Each wrapper that must precede shard_model says so when called after it."""
    out = {}
    calls = {
        "apply_activation_checkpointing": lambda m: fk.apply_activation_checkpointing(m, "full"),
        "compile_blocks": lambda m: fk.compile_blocks(m),
        "enable_float8": lambda m: fk.enable_float8(m),
    }
    for name, call in calls.items():
        model = build("llama-f8")
        fk.shard_model(model, _mesh(-1, 1))
        try:
            call(model)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _run_counted(case: Case) -> dict:
    """run_case, plus what dynamo compiled for it: graphs and graph breaks."""
    from torch._dynamo.utils import counters

    counters.clear()
    res = run_case(case)
    res["graphs"] = counters["stats"]["unique_graphs"]
    res["graph_breaks"] = sum(counters["graph_break"].values())
    return res


def run_all(cases: list[Case], memory_modes: list, with_checks: bool, key_wrappers: dict[str, list[str]]) -> dict:
    out = {"cases": [_run_counted(c) for c in cases]}
    if memory_modes:
        out["memory"] = ac_memory(memory_modes)
        out["memory_llama"] = ac_memory([None, "full", "selective", "op"], kind="llama")
    if with_checks:
        out["float8_scales"] = float8_scales()
        out["order_errors"] = order_errors()
        out["prefetch"] = prefetch_targets()
        out["unshard_in_backward"] = unshard_in_backward()
        out["compiled_regions"] = compiled_regions()
    out["keys"] = {kind: state_dict_keys(kind, wrappers) for kind, wrappers in key_wrappers.items()}
    # Only rank 0's parameters are needed by the test. They travel as numpy arrays: a tensor put
    # on a torch.multiprocessing queue is shared through a file descriptor of a process that is
    # about to exit.
    for c in out["cases"]:
        c["params"] = {n: t.numpy() for n, t in c["params"].items()} if dist.get_rank() == 0 else {}
    return out
