"""The step's memory timeline: FSDP2's allocations replayed over a recorded step, at any mesh size (how and why:
docs/internals.md, section fsdp2kit/planner/timeline.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp2kit.planner.trace import Recording

__all__ = ["FsdpTimeline", "Replayed", "Unit", "replay"]


@dataclass
class Unit:
    """One FSDP unit's per-rank byte counts (dim-0 padding included, as FSDP2 allocates)."""

    name: str
    gathered: int  # unsharded parameters in the compute dtype
    unsharded_grads: int  # gradients of the trainable unsharded parameters, compute dtype
    reduce_input: int  # the flat reduce-scatter input, reduce dtype
    reduce_output: int  # its per-rank output in the reduce dtype
    sharded_grads: int  # what stays as .grad, master dtype
    reshard_after_forward: bool
    gather_in_backward: bool = True  # False: a plain nn.Embedding unit (set_unshard_in_backward(False))
    # state during the step
    unsharded: bool = False
    pending_gather: int = 0  # flat all-gather output waiting for its copy-out (-1: requested, one rank)
    grads_live: int = 0
    backward_done: bool = False


@dataclass
class FsdpTimeline:
    units: list[Unit]
    world: int  # ranks in the shard group (1: no all-gather buffers at all)
    see: Callable[..., None]  # called at each moment FSDP2's hooks pass through (replay's ``check``)
    prefetch: int = 0  # explicit forward/backward prefetch depth (fk.set_prefetch); 0: FSDP2's implicit
    blocks: list[int] = field(default_factory=list)  # unit indices of the blocks, forward order
    clone_reduce_input: bool = False  # gloo: the reduce-scatter clones its input (docs/internals.md)
    final_order: list[int] = field(default_factory=list)  # end of backward; empty: index order
    gathered: int = 0  # unsharded parameters alive
    buffers: int = 0  # all-gather and reduce-scatter flat buffers alive
    grads_unsharded: int = 0
    grads_sharded: int = 0
    _ag_state: int = 0
    _rs_state: int = 0
    forward_order: list[int] = field(default_factory=list)  # unit indices, as their forwards end

    def _start_gather(self, u: Unit) -> None:
        if u.unsharded or u.pending_gather:
            return
        u.pending_gather = u.gathered if self.world > 1 else -1
        self.buffers += max(u.pending_gather, 0)

    def _finish_gather(self, u: Unit, *, forward: bool, keep_flat: bool) -> None:
        if u.unsharded:
            return
        if not u.pending_gather:
            self._start_gather(u)
        flat = max(u.pending_gather, 0)
        u.pending_gather = 0
        if forward and self._ag_state:
            # The previous unit's kept flat buffer goes before this copy-out, after this unit's all-gather
            # filled its own (FSDPParamGroup.wait_for_unshard): both are alive while FSDP2's ops run.
            self.see(ops=True)
            self.end_forward()
        self.gathered += u.gathered
        u.unsharded = True
        self.see()
        if keep_flat:
            self._ag_state = flat
        else:
            self.buffers -= flat

    def _reshard(self, u: Unit) -> None:
        if u.unsharded:
            self.gathered -= u.gathered
            u.unsharded = False

    def pre_forward(self, index: int) -> None:
        u = self.units[index]
        if index in self.forward_order:
            return
        # A unit gathered by an explicit prefetch does not keep its flat buffer (FSDPParamGroup.wait_for_unshard).
        self._finish_gather(u, forward=True, keep_flat=not u.pending_gather and self.world > 1)
        if self.prefetch > 0 and index in self.blocks:
            at = self.blocks.index(index)
            for nxt in self.blocks[at + 1 : at + 1 + self.prefetch]:
                self._start_gather(self.units[nxt])

    def post_forward(self, index: int) -> None:
        if index not in self.forward_order:
            self.forward_order.append(index)
            if self.units[index].reshard_after_forward:
                self._reshard(self.units[index])

    def end_forward(self) -> None:
        """The root's post-forward frees the last flat all-gather output (FSDPState._post_forward)."""
        self.buffers -= self._ag_state
        self._ag_state = 0

    def pre_backward(self, index: int) -> None:
        u = self.units[index]
        if u.backward_done:
            return
        if u.gather_in_backward:
            self._finish_gather(u, forward=False, keep_flat=False)
        if index in self.forward_order:
            i = self.forward_order.index(index)
            for prev in [self.units[k] for k in self.forward_order[max(0, i - max(1, self.prefetch)) : i][::-1]]:
                if not prev.backward_done and prev.gather_in_backward:
                    self._start_gather(prev)

    def grad(self, index: int, nbytes: int) -> None:
        u = self.units[index]
        if not u.backward_done:  # a straggler after the reduce-scatter is reduced at the end: ignored
            u.grads_live += nbytes
            self.grads_unsharded += nbytes
        self.see()

    def post_backward(self, index: int) -> None:
        """Reshard, reduce-scatter."""
        u = self.units[index]
        if u.backward_done:
            return
        u.backward_done = True
        self._reshard(u)
        self.buffers -= self._rs_state
        self._rs_state = 0
        if not u.grads_live:
            return
        self.buffers += u.reduce_input
        self.see()
        self.grads_unsharded -= u.grads_live
        u.grads_live = 0
        self.buffers += u.reduce_output
        self.see(clone=u.reduce_input if self.clone_reduce_input else 0)  # gloo's copy, for the call
        self.buffers -= u.reduce_output
        self.grads_sharded += u.sharded_grads  # a cast copy (reduce dtype != master) or the output itself
        self._rs_state = u.reduce_input

    def end_backward(self) -> None:
        for i in self.final_order or range(len(self.units)):
            u = self.units[i]
            if not u.backward_done and (u.unsharded or u.grads_live):
                self.post_backward(i)
        for u in self.units:
            self._reshard(u)
        self.buffers -= self._rs_state + self._ag_state
        self._rs_state = self._ag_state = 0


@dataclass
class Replayed:
    """The step's figures at the full depth and the given mesh (parameters and optimizer state excluded)."""

    peak: int = 0
    phase: str = ""
    parts: dict[str, int] = field(default_factory=dict)
    forward_peak: int = 0
    backward_peak: int = 0
    saved_activations: int = 0  # live after the last block's forward: blocks' saved tensors, inputs, batch
    saved_by_block: list[int] = field(default_factory=list)
    logits_and_loss: int = 0
    grads_sharded: int = 0
    max_gathered: int = 0  # the most unsharded parameters alive while ops run
    max_buffers: int = 0  # the most flat all-gather / reduce-scatter buffers alive while ops run


def _expand(rec: Recording, block_names: list[str]) -> list[tuple]:
    """The events with the middle block's forward and backward repeated for the blocks that did not run."""
    if not rec.repeat:
        return rec.events
    ev = rec.events
    b0, b1, b2 = rec.blocks[-3:]  # the block before the representative, the representative, the last

    f1, f2 = ev.index(("phase", f"forward {b1}")), ev.index(("phase", f"forward {b2}"))
    k1, k0 = ev.index(("phase", f"backward {b1}")), ev.index(("phase", f"backward {b0}"))
    middle = block_names[len(rec.blocks) - 2 : -1]

    def renamed(segment: list[tuple], name: str) -> list[tuple]:
        return [(e[0], e[1].replace(b1, name, 1)) if e[0] in ("phase", "enter", "exit") else e for e in segment]

    out = ev[:f1]
    for name in middle:
        out += [("as", name), *renamed(ev[f1:f2], name), ("as", None)]
    out += ev[f2:k1]
    for name in reversed(middle):
        out += [("as", name), *renamed(ev[k1:k0], name), ("as", None)]
    return out + ev[k0:]


def replay(
    rec: Recording,
    units: list[Unit],
    unit_names: list[list[str]],
    block_names: list[str],
    *,
    world: int,
    prefetch: int,
    clone_reduce_input: bool = False,
    final_order: list[str] | None = None,
    final_transient: int = 0,
) -> Replayed:
    """The recorded step through `FsdpTimeline` for copies of ``units``; ``final_order``: a module of each unit in
    FSDP2's final callback's order; ``final_transient``: bytes for a moment after it (replicated grads' all-reduce)."""
    units = [copy.copy(u) for u in units]
    index_of = {n: i for i, names in enumerate(unit_names) for n in names}
    blocks = [index_of[n] for n in block_names]
    out = Replayed()
    middle_unit = index_of[rec.blocks[-2]] if rec.repeat else None
    level, phase, alias, backward, after_blocks = 0, "", None, False, 0
    held: dict[str, int] = {}
    entered: dict[str, int] = {}
    done: set[str] = set()

    def check(rise: int = 0, clone: int = 0, ops: bool = False) -> None:
        """A moment: ``rise`` above the ops' level, ``clone`` bytes beside FSDP2's (a transient); ``ops``: while ops
        run, outside FSDP2's own hooks (the maxima reported are those)."""
        if ops:
            out.max_gathered = max(out.max_gathered, tl.gathered)
            out.max_buffers = max(out.max_buffers, tl.buffers)
        total = level + rise + tl.gathered + tl.buffers + tl.grads_unsharded + tl.grads_sharded + clone
        side = "backward_peak" if backward else "forward_peak"
        setattr(out, side, max(getattr(out, side), total))
        if total > out.peak:
            act = min(sum(v for k, v in held.items() if k not in done), level + rise)
            out.peak, out.phase = total, phase
            out.parts = {
                "gathered": tl.gathered,
                "comm_buffers": tl.buffers,
                "unsharded_grads": tl.grads_unsharded,
                "grads": tl.grads_sharded,
                "activations": act,
                "temporaries": level + rise - act + clone,
            }

    final = [index_of[n] for n in final_order or []]
    tl = FsdpTimeline(units, world, check, prefetch, blocks, clone_reduce_input, final)
    for e in _expand(rec, block_names):
        kind = e[0]
        if kind == "as":
            alias = e[1]
            continue
        if alias is not None and kind in ("pre_forward", "post_forward", "pre_backward", "post_backward", "grad"):
            e = (kind, index_of[alias] if e[1] == middle_unit else e[1], *e[2:])
        if kind == "ops":
            check(rise=e[1], ops=True)
            level += e[2]
        elif kind == "phase":
            phase = e[1]
        elif kind == "enter":
            entered[e[1]] = level
        elif kind == "exit":
            if e[1] in block_names:
                held[e[1]] = level - entered[e[1]]
                after_blocks = level
        elif kind == "loss_done":
            out.saved_activations = after_blocks
            out.saved_by_block = [held.get(n, 0) for n in block_names]
            out.logits_and_loss = level - after_blocks
            held["(loss)"] = out.logits_and_loss
            backward = True
        else:  # one of FSDP2's hooks, a `FsdpTimeline` method of the same name
            if kind == "pre_backward" and e[1] in blocks:
                done.add("(loss)")
            elif kind == "post_backward":
                done.update(unit_names[e[1]])
            getattr(tl, kind)(*e[1:])
            if kind == "end_backward" and final_transient:
                check(clone=final_transient)
    out.grads_sharded = tl.grads_sharded
    return out
