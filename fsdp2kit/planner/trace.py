"""One training step run on the meta device (shapes only, no memory), recorded as a sequence of memory events (how and
why: docs/internals.md, section fsdp2kit/planner/trace.py)."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from fsdp2kit._internal.scoped import divert
from fsdp2kit.blocks import find_blocks
from fsdp2kit.parallel.context_parallel import check_heads
from fsdp2kit.planner.live import LiveBytes
from fsdp2kit.weights.nf4 import is_nf4, meta_nf4

__all__ = ["Recording", "block_names", "meta_copy", "record_step", "run_step", "step_model", "unit_modules"]

# Blocks that run as themselves before the one that stands for the middle ones: the first two hold a little
# more than the rest (the embedding's and first block's outputs are still referenced), measured on Llama.
_LEAD = 3


@dataclass
class Recording:
    """The events of one step; op runs are ``("ops", rise, net)``: the run's highest and final live bytes, both
    relative to the level before it."""

    events: list[tuple] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)  # names of the blocks that ran, in forward order
    repeat: int = 0  # how many blocks that did not run the representative (blocks[-2]) stands for


class _PostBackward(torch.autograd.Function):
    """Identity in forward; its backward runs once the gradient w.r.t. a unit's inputs exists."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def block_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s repeated blocks (`find_blocks`), in order."""
    names_of = {id(m): n for n, m in model.named_modules()}
    return [names_of[id(b)] for b in find_blocks(model)]


def _signature(block: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
    return (type(block).__name__, getattr(block, "attention_type", None), *params)


def meta_copy(
    model: nn.Module,
    dtype: torch.dtype | None,
    keep: list[nn.Module] | None = None,
    shapes: dict[int, tuple[int, ...]] | None = None,
    own_dtype: frozenset[int] = frozenset(),
) -> nn.Module:
    """A meta deep copy of ``model``: floating parameters in ``dtype`` (None, or id in ``own_dtype``: theirs), only the
    blocks in ``keep``, parameters (by id) in ``shapes`` so shaped (a TP rank's slices), NF4 as meta NF4."""
    memo: dict[int, object] = {}
    # Parameters and buffers go into the memo first, so deepcopy never copies real storage.
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo or (is_traceable_wrapper_subclass(t) and t.device.type == "meta"):
            memo.setdefault(id(t), t)  # a meta wrapper subclass (meta NF4) stays as it is
        elif is_nf4(t):  # a real NF4 weight (QLoRA from a fresh init): its meta placeholder, same inner tensors
            nf4 = meta_nf4(t.shape, t.dtype, t.block_size, t.scaler_block_size)
            memo[id(t)] = nn.Parameter(nf4, requires_grad=False)
        else:
            own = dtype is None or not t.is_floating_point() or not isinstance(t, nn.Parameter) or id(t) in own_dtype
            new = torch.empty((shapes or {}).get(id(t), t.shape), dtype=t.dtype if own else dtype, device="meta")
            memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    if keep is not None:
        first = find_blocks(model)[0]
        for parent in model.modules():
            if isinstance(parent, nn.ModuleList) and any(c is first for c in parent):
                memo[id(parent)] = nn.ModuleList([copy.deepcopy(c, memo) for c in parent if any(c is k for k in keep)])
    return copy.deepcopy(model, memo)


def _all_to_all(x: torch.Tensor, cp: int, split: int, cat: int) -> torch.Tensor:
    """``x`` through one ``all_to_all_single`` on a rank: dim ``split`` cut into ``cp`` blocks, a contiguous send
    buffer, the receive buffer, the received blocks put in order along dim ``cat`` (a copy)."""
    send = x.unflatten(split, (cp, -1)).movedim(split, 0).contiguous()
    recv = torch.empty_like(send)
    del send
    return recv.movedim(0, cat).flatten(cat, cat + 1)


class _AllToAll(torch.autograd.Function):
    """``(b, heads, seq/cp, d)`` -> ``(b, heads/cp, seq, d)`` (``to_heads``) or the output back as ``(b, seq/cp, heads,
    d)``, with the copies `fsdp2kit.apply_context_parallel`'s all-to-all style makes; saves nothing."""

    @staticmethod
    def forward(ctx, x, cp, to_heads):
        ctx.cp, ctx.to_heads = cp, to_heads
        if to_heads:
            return _all_to_all(x, cp, 1, 2).clone()  # the reorder's index_select
        ordered = x.transpose(1, 2).contiguous().clone()  # transformers' layout, then the reorder
        return _all_to_all(ordered, cp, 1, 2).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_heads:  # index_select's backward first
            return _all_to_all(grad.clone(), ctx.cp, 2, 1), None, None
        return _all_to_all(grad.transpose(1, 2), ctx.cp, 2, 1).clone().transpose(1, 2), None, None


def _half_added(t: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """torch's ring's ``_partial_update(t, new, dim=2, n_chunks=2, idx=0, add=True)``: a new tensor."""
    head, tail = t.chunk(2, dim=2)
    head += new
    return torch.cat([head, tail], dim=2)


def _ring_kv(i: int, cp: int, k: torch.Tensor, v: torch.Tensor, every: torch.Tensor | None) -> tuple:
    """Ring step ``i`` (forward and backward alike): k and v concatenated at every step but the last and
    all-gathered at the first (``every``); the k, v blocks it attends to (after the first, views of ``every``)."""
    if i < cp - 1:
        sent = torch.cat([k.flatten(), v.flatten()])
        every = sent.new_empty(cp * sent.numel()) if every is None else every
        del sent
    return every, *((k, v) if i == 0 else (k.chunk(2, dim=2)[0], v.chunk(2, dim=2)[0]))


class _RingAttention(torch.autograd.Function):
    """The ring style's attention on the last cp rank (the largest blocks), allocating what torch 2.13's ring does,
    in its order (docs/memory_planner.md, "The ring style")."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        inputs = (q, k, v)  # what fsdp2kit's _Ring saves; torch's ring works on contiguous copies of k and v
        k, v = k.contiguous(), v.contiguous()
        every = out = lse = None  # the rotater's gathered k and v; the merger's output and log-sum-exp
        for i in range(cp):
            every, kb, vb = _ring_kv(i, cp, k, v, every)
            # the block's output stays referenced until the next block's, as torch's loop variable
            o, o_lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, kb, vb, None, True, 0.0, i == 0)[:2]
            o32, l32 = o.float(), o_lse.unsqueeze(-1)
            if out is None:
                out, lse = o32, l32
            else:
                out = out - torch.sigmoid(l32 - lse) * (out - o32)
                lse = lse - F.logsigmoid(lse - l32)
            del o32, l32
        out = out.to(q.dtype)
        ctx.save_for_backward(*inputs, out, lse.squeeze(-1))
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad, k, v = grad.contiguous(), k.contiguous(), v.contiguous()  # _Ring's and torch's ring's copies
        seed = torch.empty((), dtype=torch.long, device=q.device)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        every = sent = arrived = None  # gathered k and v; the dk, dv sent (torch's next_grad_kv) and arriving
        for i in range(ctx.cp):
            every, kb, vb = _ring_kv(i, ctx.cp, k, v, every)
            dq_, dk_, dv_ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                grad, q, kb, vb, None, out, lse, seed, seed, 0.0, (True, True, True, False), i == 0
            )[:3]
            if i == 0:
                dk += dk_
                dv += dv_
            else:  # the dk, dv that arrived (the one sent is freed), this block's added to their first half
                sent = arrived
                dk, dv = sent[: k.numel()].view(k.shape), sent[k.numel() :].view(v.shape)
                dk, dv = _half_added(dk, dk_), _half_added(dv, dv_)
            sent = torch.cat([dk.flatten(), dv.flatten()])
            arrived = torch.empty_like(sent)  # permute_tensor's output: the previous rank's dk, dv
            dq += dq_
        home = arrived.to(k.dtype)
        return dq.to(q.dtype), home[: k.numel()].view(k.shape), home[k.numel() :].view(v.shape), None


@contextlib.contextmanager
def _as_a_real_step(cp: int = 1, style: str = "all_to_all"):
    """What must differ between a shapes-only step and a real one (docs/memory_planner.md, "How" and "MoE"),
    diverted for this thread only: not a TorchFunctionMode, none is active while backward recomputes a block."""

    def sdpa(original, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta":
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

        def flash(q, k, v):
            kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return kernel(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

        if cp > 1 and style == "ring":
            groups = q.shape[1] // k.shape[1]  # GQA: k and v repeated to the query heads first, as the ring does
            k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
            return _RingAttention.apply(q, k, v, cp)
        if cp == 1:
            return flash(q, k, v)
        # Context parallelism, all-to-all (Ulysses) style: this rank holds seq/cp tokens of every head; q, then k and
        # v stacked (one exchange) go to heads/cp heads over the whole sequence, the output back to this rank's
        # tokens (docs/memory_planner.md, "Context parallelism").
        check_heads(cp, q.shape[1], k.shape[1])
        b, kv_heads, s, d = k.shape
        q = _AllToAll.apply(q, cp, True)
        kv = _AllToAll.apply(torch.stack([k, v], dim=2).reshape(b, 2 * kv_heads, s, d), cp, True)
        kv = kv.unflatten(1, (kv_heads // cp, 2))
        return _AllToAll.apply(flash(q, kv[:, :, 0], kv[:, :, 1]), cp, False)

    def grouped_on_meta(can_grouped, input, weight, offs) -> bool:
        return (weight.device.type != "meta" or weight.dtype == torch.bfloat16) and can_grouped(input, weight, offs)

    with contextlib.ExitStack() as stack:
        masking = sys.modules.get("transformers.masking_utils")
        for name, answer in (("is_tracing", False), ("find_packed_sequence_indices", None)):
            if hasattr(masking, name):
                stack.enter_context(divert(masking, name, lambda original, *a, answer=answer, **k: answer))
        moe = sys.modules.get("transformers.integrations.moe")
        if hasattr(moe, "_can_use_grouped_mm"):
            stack.enter_context(divert(moe, "_can_use_grouped_mm", grouped_on_meta))
        stack.enter_context(divert(F, "scaled_dot_product_attention", sdpa))
        yield


def on_output_grad(output, fn) -> None:
    """``fn`` runs on the gradient w.r.t. each tensor of ``output`` (transformers registers ModelOutput as a pytree)."""
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(fn)


def step_model(
    model: nn.Module,
    compute_dtype: torch.dtype | None,
    activation_checkpointing,
    lead: int | None,
    own_dtype: frozenset[int] = frozenset(),
) -> tuple[nn.Module, dict[str, nn.Module], list[str], int]:
    """``(meta copy set up for a step, its modules by the original's names, kept blocks' names, repeat)``; with ``lead``
    and identical blocks after it, only ``blocks[:lead + 1]`` (the last standing for ``repeat``) and the last run."""
    from fsdp2kit.wrappers.activation import apply_activation_checkpointing

    blocks = find_blocks(model)
    keep, repeat = None, 0
    every_n = isinstance(activation_checkpointing, int) and not isinstance(activation_checkpointing, bool)
    if lead is not None and not every_n and len(blocks) > lead + 3 and len(set(map(_signature, blocks[lead:-1]))) == 1:
        keep, repeat = [*blocks[: lead + 1], blocks[-1]], len(blocks) - lead - 2
    clone = meta_copy(model, compute_dtype, keep, own_dtype=own_dtype)
    clone.train()
    if hasattr(getattr(clone, "config", None), "use_cache"):
        clone.config.use_cache = False
    if callable(activation_checkpointing):
        activation_checkpointing(clone)
    elif activation_checkpointing is not None:
        apply_activation_checkpointing(clone, mode=activation_checkpointing)
    names = block_names(model)
    kept = names if keep is None else [*names[: lead + 1], names[-1]]
    # In the copy, the kept blocks are renumbered (layers.0, layers.1, layers.2): map them back.
    rename = dict(zip(block_names(clone), kept))
    return clone, {rename.get(n, n): m for n, m in clone.named_modules()}, kept, repeat


def unit_modules(unit_names: list[list[str]], modules: dict[str, nn.Module]) -> list[tuple[int, str, nn.Module]]:
    """``(unit index, name, module)`` for every module of ``unit_names`` that the step copy has."""
    return [(i, n, modules[n]) for i, names in enumerate(unit_names) for n in names if n in modules]


def run_step(clone, batch: int, seq: int, mark, hooks, on_grad=None, *, cp=1, cp_style="all_to_all", mode=None) -> None:
    """A forward of meta ``clone`` on ``batch`` x ``seq`` ids, the recipe's loss (fp32 logits) and backward in ``mode``,
    with ``hooks`` (module, pre-hook, hook; kwargs) and ``on_grad`` for the step; ``mark(phase)`` as phases begin."""
    handles = [m.register_forward_pre_hook(pre, with_kwargs=True, prepend=True) for m, pre, _ in hooks]
    handles += [m.register_forward_hook(post, with_kwargs=True) for m, _, post in hooks]
    if on_grad is not None:
        handles += [p.register_post_accumulate_grad_hook(on_grad) for p in clone.parameters() if p.requires_grad]
    try:
        with _as_a_real_step(cp, cp_style), mode or contextlib.nullcontext():
            # The batch is counted too: a real loop holds it for the whole step.
            ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
            labels = torch.zeros(batch * seq, dtype=torch.long, device="meta")
            if cp > 1:
                # The loop read the whole sequences and keeps them while the model runs on this rank's
                # part, which needs its positions (fsdp2kit.split_for_context_parallel).
                whole = torch.zeros(batch, seq * cp, dtype=torch.long, device="meta")  # noqa: F841
                positions = torch.zeros(batch, seq, dtype=torch.long, device="meta")
                out = clone(ids, position_ids=positions)
            else:
                out = clone(ids)
            logits = out.logits if hasattr(out, "logits") else out
            del out
            mark("forward loss")
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels)
            del logits
            mark("backward loss")
            loss.backward()
            mark("backward (end)")
    finally:
        for h in handles:
            h.remove()


def record_step(
    model: nn.Module,
    unit_names: list[list[str]],
    *,
    batch: int,
    seq: int,
    compute_dtype: torch.dtype | None,
    activation_checkpointing: str | int | None,
    truncate: bool = True,
    cp: int = 1,
    cp_style: str = "all_to_all",
    own_dtype: frozenset[int] = frozenset(),
) -> Recording:
    """One forward + backward of a meta copy of ``model``, its memory events naming units by index in ``unit_names``;
    ``seq``: a rank's tokens (with ``cp > 1``, its share, attention as ``cp_style`` runs it)."""
    lead = _LEAD if truncate else None
    clone, modules, kept_names, repeat = step_model(model, compute_dtype, activation_checkpointing, lead, own_dtype)

    rec = Recording(blocks=kept_names, repeat=repeat)
    run = {"level": 0, "high": 0, "open": False, "backward": False}
    live = LiveBytes(on_op=lambda now: run.update(high=max(run["high"], now), open=True), incremental=True)

    def emit(*event) -> None:
        if run["open"]:  # the ops since the last event
            rec.events.append(("ops", run["high"] - run["level"], live.live - run["level"]))
            run.update(level=live.live, high=live.live, open=False)
        rec.events.append(event)

    calls: Counter[int] = Counter()
    unit_size = Counter(i for i, _, _ in unit_modules(unit_names, modules))

    def make_hooks(name: str, index: int):
        label = name or "(root)"

        def backward_hook(kind: str) -> None:
            emit("phase", f"backward {label}")
            emit(kind, index)

        def pre(mod, args, kwargs):
            if run["backward"]:
                return None  # a checkpointed block recomputing: FSDP2 has it unsharded already
            emit("phase", f"forward {label}")
            calls[index] += 1
            if calls[index] == 1:
                emit("pre_forward", index)
            emit("enter", name)
            # FSDP2 runs a unit's pre-forward once, at its first module: only those inputs get the
            # post-backward hook (a tied head's unit, first called at the embedding, whose input
            # needs no gradient, reduces its gradients at the end of backward).
            grad_inputs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            if calls[index] > 1 or not grad_inputs:
                return None
            hooked = _PostBackward.apply(lambda: backward_hook("post_backward"), *[args[i] for i in grad_inputs])
            wrapped = dict(zip(grad_inputs, hooked))
            return tuple(wrapped.get(i, a) for i, a in enumerate(args)), kwargs

        def post(mod, args, kwargs, output):
            if not run["backward"]:
                emit("exit", name)
                if calls[index] == unit_size[index]:
                    emit("post_forward", index)
                if mod is clone:
                    emit("end_forward")
                on_output_grad(output, lambda grad: backward_hook("pre_backward"))

        return pre, post

    param_unit: dict[int, int] = {}  # a parameter's unit: the first that holds it
    for i, _, module in unit_modules(unit_names, modules):
        for p in module.parameters():
            param_unit.setdefault(id(p), i)

    def on_grad(p: torch.Tensor) -> None:
        # FSDP2 holds the unsharded gradient until the unit's post-backward: the timeline counts
        # it, so the recording drops it at once.
        if p.grad is not None and id(p) in param_unit:
            emit("grad", param_unit[id(p)], p.grad.untyped_storage().nbytes())
        p.grad = None

    # Parameters are the timeline's to count (sharded, gathered); buffers count from the start.
    live.ignore(clone.parameters())
    live.track(clone.buffers())
    rec.events.append(("ops", live.live, live.live))
    run["level"] = run["high"] = live.live

    def mark(phase: str) -> None:
        if phase == "backward loss":
            emit("loss_done")
            run["backward"] = True
        emit("phase", phase)
        if phase == "backward (end)":
            emit("end_backward")

    hooks = [(module, *make_hooks(n, i)) for i, n, module in unit_modules(unit_names, modules)]
    run_step(clone, batch, seq, mark, hooks, on_grad, cp=cp, cp_style=cp_style, mode=live)
    return rec
