"""measure_step: the measured per-rank peak of live tensor bytes in one real training step, by category.

The check for the planner's prediction (this benchmark's grid and tests/dist/test_memory_measured.py);
a measuring tool, not part of the library (users read ``torch.cuda.max_memory_allocated``).
Categories are told apart by identity: the parameters' local shards, their ``.grad``, the
optimizer's state, FSDP2's unsharded parameters and its flat all-gather / reduce-scatter buffers
(read from FSDP2's private state objects, which is why this lives in a measuring tool and
nowhere else); the rest is activations and temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp2kit.planner.live import LiveBytes, tensor_storages

__all__ = ["MeasuredStep", "measure_step"]


def _keys(t: torch.Tensor | None) -> set[int]:
    return {id(st) for st in tensor_storages(t)}


def _fsdp_groups(model: nn.Module) -> list:
    groups = []
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        group = getattr(get(), "_fsdp_param_group", None)
        if group is not None:
            groups.append(group)
    return groups


@dataclass
class MeasuredStep:
    peak: int = 0
    phase: str = ""
    parts: dict[str, int] = field(default_factory=dict)  # at the peak
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    max_gathered: int = 0
    max_comm_buffers: int = 0
    saved_activations: int = 0  # rest after the last block's forward (the batch included)
    logits_and_loss: int = 0  # rest added from the last block's output to the loss


class _Classifier:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.groups = _fsdp_groups(model)
        self.params = [p for p in model.parameters()]

    def sets(self) -> dict[str, set[int]]:
        params = {k for p in self.params for k in _keys(p)}
        grads = {k for p in self.params if p.grad is not None for k in _keys(p.grad)}
        opt = set()
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    opt |= _keys(v)
        gathered, buffers = set(), set()
        comm_seen = set()
        for g in self.groups:
            for fp in g.fsdp_params:
                for t in getattr(fp, "all_gather_outputs", None) or []:
                    gathered |= _keys(t)
            res = getattr(g, "_all_gather_result", None)  # a prefetched all-gather not yet copied out
            if res is not None and res.all_gather_output is not None:
                buffers |= _keys(res.all_gather_output)
            ctx = g.comm_ctx  # shared by every group of the model
            if id(ctx) in comm_seen:
                continue
            comm_seen.add(id(ctx))
            ag = getattr(ctx, "all_gather_state", None)
            if ag is not None:
                buffers |= _keys(ag.all_gather_result.all_gather_output)
            for rs in getattr(ctx, "reduce_scatter_states", []) or []:
                buffers |= _keys(rs.reduce_scatter_input)
        return {"params": params, "grads": grads, "optimizer": opt, "gathered": gathered, "comm_buffers": buffers}

    def classify(self, live: LiveBytes) -> dict[str, int]:
        sets = self.sets()
        out = dict.fromkeys([*sets, "rest"], 0)
        for st in live.storages():
            k, n = id(st), st.nbytes()
            for name, keys in sets.items():
                if k in keys:
                    out[name] += n
                    break
            else:
                out["rest"] += n
        return out


def measure_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[], torch.Tensor],
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    blocks: list[nn.Module],
    micro_batches: int = 1,
    accumulation: str = "regather",
) -> MeasuredStep:
    """Run one step (``loss_fn(model, make_batch())``, backward, ``optimizer.step()``, ``zero_grad``) and measure it;
    with ``micro_batches`` > 1, that many forwards and backwards under `fsdp2kit.accumulate`'s ``accumulation``.

    Run a warm-up step first so the optimizer state exists, as in any step after the first.
    """
    import contextlib

    from fsdp2kit.accumulation import accumulate

    result = MeasuredStep()
    clf = _Classifier(model, optimizer)
    live = LiveBytes()

    def on_op(_: int) -> None:
        sets = clf.sets()
        sizes = {}
        for st in live.storages():
            for name in ("gathered", "comm_buffers"):
                if id(st) in sets[name]:
                    sizes[name] = sizes.get(name, 0) + st.nbytes()
        result.max_gathered = max(result.max_gathered, sizes.get("gathered", 0))
        result.max_comm_buffers = max(result.max_comm_buffers, sizes.get("comm_buffers", 0))

    def on_peak(total: int) -> None:
        result.peak = total
        result.phase = live.label
        result.parts = clf.classify(live)

    live.on_op, live.on_peak = on_op, on_peak
    names = {id(m): n for n, m in model.named_modules()}
    handles = []
    marks: dict[str, int] = {}

    def fwd_pre(mod, args):
        live.label = f"forward {names[id(mod)]}"

    def fwd_post(mod, args, output):
        if torch.is_grad_enabled() and mod is blocks[-1] and "after_blocks" not in marks:
            marks["after_blocks"] = clf.classify(live)["rest"]
        label = f"backward {names[id(mod)]}"

        def pre_backward(grad: torch.Tensor) -> None:
            live.label = label

        for t in output if isinstance(output, tuple) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(pre_backward)

    for b in blocks:
        handles.append(b.register_forward_pre_hook(fwd_pre))
        handles.append(b.register_forward_hook(fwd_post))
    try:
        live.track(list(model.parameters()) + list(model.buffers()))
        live.track([v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
        with live:
            for i in range(micro_batches):
                scope = accumulate(model, accumulation, i, micro_batches) if micro_batches > 1 else None
                with scope or contextlib.nullcontext():
                    live.label = "forward"
                    batch = make_batch()
                    loss = loss_fn(model, batch)
                    live.update()
                    if i == 0:
                        result.saved_activations = marks.get("after_blocks", 0)
                        result.logits_and_loss = clf.classify(live)["rest"] - result.saved_activations
                    live.label = "backward loss"
                    loss.backward()
            live.label = "after backward"
            live.update()
            parts = clf.classify(live)
            result.grads = parts["grads"]
            result.params = parts["params"]
            live.label = "optimizer step"
            optimizer.step()
            live.update()
            result.optimizer = clf.classify(live)["optimizer"]
            optimizer.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    return result
