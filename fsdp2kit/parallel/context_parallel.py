"""apply_context_parallel: attention over a sequence split across the cp ranks (docs/long-sequences.md)."""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2kit._internal.markers import CONTEXT_PARALLEL, TENSOR_PARALLEL
from fsdp2kit.parallel.cp_inputs import chunk_order, document_mask, sub_mesh
from fsdp2kit.parallel.tensor_parallel import _config_sizes
from fsdp2kit.wrappers.forward import check_order

__all__ = ["RING_CUDA_ONLY", "RING_PACKED", "STYLES", "apply_context_parallel", "check_ring_seq"]

STYLES = ("all_to_all", "ring")
KERNELS = ("sdpa", "eager")  # the inner kernels run on each rank's heads over the whole sequence
_names = itertools.count()


def _exchange(x: torch.Tensor, cp: int, group: DeviceMesh) -> torch.Tensor:
    """Dim 1 cut in cp parts, part j to cp rank j, those received joined along dim 2 in rank order: heads over local
    tokens -> a head group over all tokens, and back (backward: funcol's all_to_all_single has its own)."""
    out = funcol.all_to_all_single(torch.stack(x.chunk(cp, dim=1)), None, None, group)
    out = funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out
    return torch.cat(out.unbind(0), dim=2)


def _reorder(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with its ``dim`` cut into ``len(index)`` chunks, reordered by ``index``."""
    chunks = x.unflatten(dim, (index.numel(), x.shape[dim] // index.numel()))
    return chunks.index_select(dim, index).flatten(dim, dim + 1)


def _inner_kernel(name: str, module: nn.Module) -> Callable:
    if name == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    # transformers' eager attention is defined per model file (the model's own, with its extras)
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"context parallelism: {type(module).__name__}'s module has no eager_attention_forward")
    return fn


class _Positions:
    """The gathered positions, once per forward (the layers and AC's recompute share one position_ids tensor), and
    their mask, held weakly: alive while a kernel saved it for backward, else built again."""

    def __init__(self):
        self.key: tuple | None = None
        self.positions = self.mask = None
        self.none = False  # one document a row under the kernel's causal flag: no mask

    def get(self, position_ids: torch.Tensor, batch: int, gather: Callable, build: Callable):
        if torch.compiler.is_compiling():
            return build(gather())
        # the batch too: one (1, seq) position_ids tensor serves batches of any size, and the mask has their rows
        key = (weakref.ref(position_ids), position_ids._version, batch)
        if self.key is None or self.key[0]() is not position_ids or self.key[1:] != key[1:]:
            self.key, self.positions, self.mask, self.none = key, gather(), None, False
        mask = None if self.none or self.mask is None else self.mask()
        if mask is None and not self.none:
            mask = build(self.positions)
            self.none, self.mask = mask is None, (None if mask is None else weakref.ref(mask))
            if self.none:
                self.positions = None  # not needed again: held until the next forward, it would outlive the step
        return mask


def _check_call(attention_mask, position_ids, kwargs: dict) -> None:
    if attention_mask is not None:
        raise ValueError(
            "context parallelism got an attention mask: padding masks are not supported; keep documents apart "
            "with position_ids (see fsdp2kit.split_for_context_parallel)"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError("context parallelism does not support sliding-window attention layers")
    if position_ids is None:
        raise ValueError("context parallelism needs position_ids: pass split_for_context_parallel's to the model")


def _natural(cp: int) -> torch.Tensor:
    """The layout slot of each of the ``2 * cp`` chunks, in sequence order."""
    return torch.tensor(sorted(range(2 * cp), key=chunk_order(cp).__getitem__))


def _gather(position_ids: torch.Tensor, batch: int, group: DeviceMesh, cp: int) -> torch.Tensor:
    """The whole rows' positions in token order, from this rank's position_ids."""
    every = funcol.all_gather_tensor(position_ids.expand(batch, -1).contiguous(), 0, group)  # (cp * batch, n)
    every = funcol.wait_tensor(every) if isinstance(every, funcol.AsyncCollectiveTensor) else every
    made_up = torch.arange(every.shape[1], device=every.device)
    if not torch.compiler.is_compiling() and bool((every == made_up).all()):
        # 0..n-1 on every cp rank is what a model makes up when given no position_ids (it sees n tokens):
        # the split's positions never look so (rank r's head chunk starts at r x n / 2)
        raise ValueError(
            "context parallelism got the same positions 0..n-1 on every cp rank, the model's default when no "
            "position_ids are given: pass the position_ids of fsdp2kit.split_for_context_parallel to the model"
        )
    every = every.view(cp, batch, -1).transpose(0, 1).reshape(batch, -1)  # layout order
    return _reorder(every, _natural(cp).to(every.device), dim=1)


def _ulysses(group: DeviceMesh, cp: int, kernel: str) -> Callable:
    natural, layout = _natural(cp), torch.tensor(chunk_order(cp))
    cache = _Positions()

    def build(every: torch.Tensor, causal: bool, dtype: torch.dtype):
        mask = document_mask(every, causal=causal)
        if mask is None and kernel == "eager":  # one document a row: the causal mask (sdpa has a flag for it)
            mask = torch.ones(every.shape[1], every.shape[1], dtype=torch.bool, device=every.device).tril_()[None, None]
        if mask is None:
            return None
        # additive, in the kernel's dtype: one the layers share (SDPA copies a boolean one per layer)
        zero, low = (torch.tensor(v, dtype=dtype, device=mask.device) for v in (0, torch.finfo(dtype).min))
        return torch.where(mask, zero, low)

    def attention(module, query, key, value, attention_mask, *, position_ids=None, **kwargs):
        _check_call(attention_mask, position_ids, kwargs)
        causal = getattr(module, "is_causal", True)
        batch, dtype = query.shape[0], query.dtype
        gather = lambda: _gather(position_ids, batch, group, cp)
        mask = cache.get(position_ids, batch, gather, lambda e: build(e, causal, dtype))
        nat, lay = natural.to(query.device), layout.to(query.device)
        q = _reorder(_exchange(query, cp, group), nat, dim=2)
        # k and v travel in one exchange (two all-to-alls in, one out), each KV head's k and v side by side
        # so that every rank receives the k and the v of the same heads
        b, kv_heads, s, d = key.shape
        kv = torch.stack([key, value], dim=2).reshape(b, 2 * kv_heads, s, d)
        kv = _reorder(_exchange(kv, cp, group), nat, dim=2).unflatten(1, (kv_heads // cp, 2))
        k, v = kv[:, :, 0], kv[:, :, 1]
        kwargs.pop("is_causal", None)
        out, _ = _inner_kernel(kernel, module)(module, q, k, v, mask, is_causal=causal, **kwargs)
        out = _reorder(out, lay, dim=1)  # (batch, seq, heads / cp, dim) back in the layout order
        return _exchange(out, cp, group), None

    return attention


class _Ring(torch.autograd.Function):
    """Causal attention by torch's own ring (its ``context_parallel``'s) on the memory-efficient CUDA kernel,
    called on local tensors: no DTensor dispatch is switched on for the process."""

    @staticmethod
    def forward(ctx, q, k, v, scale, group):
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring

        if not ring._cp_options.enable_load_balance:  # set by a torch context_parallel() call without balance
            raise ValueError("style='ring': torch's context-parallel load balance is switched off in this process")
        attend = ring._scaled_dot_product_ring_efficient_attention
        out, lse, seed, offset = attend(group, q, k, v, None, True, 0.0, True, scale=scale)[:4]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring

        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        backward = ring._scaled_dot_product_ring_efficient_attention_backward
        which = (True, True, True, False)  # q, k, v; no bias
        args = (q, k, v, None, out, lse, seed, offset, 0.0, which, True)
        grads = backward(ctx.group, grad.contiguous(), *args, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


def _ring(group: DeviceMesh, cp: int) -> Callable:
    cache = _Positions()

    def one_document(every: torch.Tensor) -> None:
        if bool((every[:, 1:] != every[:, :-1] + 1).any()):
            raise ValueError(RING_PACKED)

    def attention(module, query, key, value, attention_mask, *, position_ids=None, scaling=None, **kwargs):
        _check_call(attention_mask, position_ids, kwargs)
        if not getattr(module, "is_causal", True):
            raise ValueError("style='ring' runs causal attention only (torch's ring load balance assumes it)")
        if kwargs.get("dropout"):
            raise ValueError("style='ring' runs without attention dropout")
        unused = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
        if unused:
            raise ValueError(f"style='ring' has no {' or '.join(unused)} (torch's ring kernel takes neither); "
                             "use style='all_to_all'")  # fmt: skip
        if query.device.type != "cpu":  # (on CPU only a stood-in kernel runs: tests)
            check_ring_seq(query.shape[2] * cp, cp)  # same shapes on every rank: all raise
        cache.get(position_ids, query.shape[0], lambda: _gather(position_ids, query.shape[0], group, cp), one_document)
        groups = query.shape[1] // key.shape[1]  # GQA: the kernel wants as many k/v heads as q heads
        k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
        return _Ring.apply(query, k, v, scaling, group).transpose(1, 2).contiguous(), None

    return attention


RING_CUDA_ONLY = "style='ring' runs on CUDA only (torch's ring attention over its CUDA kernels)"
RING_PACKED = (
    "style='ring' got packed rows (positions restart inside a row): torch's ring attention masks "
    "causally over the whole row, so documents would attend to each other; use style='all_to_all'"
)


def check_ring_seq(seq: int, cp: int) -> None:
    """``ValueError`` unless each rank's two chunks of a ``seq``-token row are multiples of 32 tokens (the CUDA
    kernel pads its log-sum-exp to 32 and torch's ring merges by it); the planner checks with this too."""
    if seq % (64 * cp):
        raise ValueError(
            f"style='ring' needs the sequence to divide by 64 x cp = {64 * cp} tokens, got {seq}; "
            "pad the rows (or use style='all_to_all')"
        )


def check_heads(cp: int, heads: int, kv_heads: int, tp: int = 1) -> None:
    """``ValueError`` unless cp divides one TP rank's heads and KV heads (the planner's check too, same words)."""
    if heads % cp or kv_heads % cp:
        per = f" per TP rank (tp={tp})" if tp > 1 else ""
        raise ValueError(
            f"all-to-all context parallelism over cp={cp} ranks splits the attention heads: {heads} heads and "
            f"{kv_heads} KV heads{per} must both divide by {cp}; choose a cp that divides them"
        )


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, *, style: str = "all_to_all") -> nn.Module:
    """Make ``model``'s attention run on a sequence split over ``mesh["cp"]``; before `shard_model`. Returns ``model``.

    ``style``: ``"all_to_all"`` (DeepSpeed-Ulysses; CPU/gloo included; heads and KV heads per TP rank must divide
    by cp; packed documents kept apart) or ``"ring"`` (CUDA only: torch's ring attention, one document a row).
    For transformers models with the ``sdpa`` or ``eager`` kernel: the function is registered in their
    ``AttentionInterface`` under a name of its own, set on this model's config only and removed with the model.
    Refused with a ``ValueError``: another model or kernel, a second call, one after `shard_model`, a mesh without
    ``"cp"``.
    How, costs and limits: docs/long-sequences.md.
    """
    if style not in STYLES:
        raise ValueError(f"apply_context_parallel: style must be one of {STYLES}, got {style!r}")
    group = sub_mesh(mesh, "apply_context_parallel", required=True)
    if style == "ring" and group.device_type != "cuda":
        raise ValueError(
            f"apply_context_parallel: {RING_CUDA_ONLY}, this mesh is on {group.device_type}; use style='all_to_all'"
        )
    check_order(model, "apply_context_parallel")
    sizes = _config_sizes(model)
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise ValueError(
            "apply_context_parallel works on transformers models (their attention-function registry); "
            f"{type(model).__name__} is not one"
        )
    if "num_attention_heads" not in sizes:
        raise ValueError(f"apply_context_parallel: {type(model).__name__}'s config has no num_attention_heads")
    cp = group.size()
    tp = (getattr(model, TENSOR_PARALLEL, None) or {}).get("tp", 1)
    if style == "all_to_all":
        check_heads(cp, sizes["num_attention_heads"] // tp, sizes["num_key_value_heads"] // tp, tp)
    kernel = model.config._attn_implementation or "eager"
    if kernel not in KERNELS:
        raise ValueError(
            f"apply_context_parallel supports attn_implementation {KERNELS}; {type(model).__name__} has {kernel!r}"
        )
    from transformers import AttentionInterface

    name = f"fsdp2kit_cp{next(_names)}_{kernel}"
    AttentionInterface.register(name, _ulysses(group, cp, kernel) if style == "all_to_all" else _ring(group, cp))
    weakref.finalize(model, AttentionInterface._global_mapping.pop, name, None)
    model.config._attn_implementation = name
    setattr(model, CONTEXT_PARALLEL, {"cp": cp, "style": style, "kernel": kernel, "attn_implementation": name})
    return model
