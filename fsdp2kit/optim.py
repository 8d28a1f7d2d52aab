"""make_optimizer: an AdamW by name, full precision or with low-precision state, over a sharded model.

Call it last, after `shard_model` and `materialize`/`load_pretrained` (the optimizer must see the
sharded DTensor parameters). It takes only the trainable parameters, so a LoRA/QLoRA base keeps
no state. The choices, by what the optimizer state costs per trainable parameter:

=================  ==========================================  ===============================================
name               state per parameter                         needs
=================  ==========================================  ===============================================
``adamw``          2 x the master dtype (8 B fp32, 4 B bf16)   nothing; torch picks foreach/fused
``adamw8bit``      2 x (1 B + 4 B / 256)  ~ 2.03 B             torchao; torch.compile (inductor) for its step
``adamw4bit``      2 x (0.5 B + 4 B / 128) ~ 1.06 B            torchao; torch.compile (inductor) for its step
``adamw_fp8``      2 x (1 B + 4 B / 256)  ~ 2.03 B             torchao; torch.compile; float8_e4m3fn casts
``adamw_bf16sr``   2 x 2 B (bf16)                              bf16 parameters: ``mixed_precision="pure_bf16"``
=================  ==========================================  ===============================================

Low-bit states do not depend on the mesh (pytorch/ao#4912): whether a parameter's state is
quantized, and in which blocks, is decided from its *global* shape (`block_for`), so every block of
every shard is a block of the whole tensor. With bf16 parameters (``pure_bf16``) torch's ``adamw``
warns and every torchao choice rounds stochastically. docs/optimizers.md says why and what the
tests bound.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["OPTIMIZERS", "block_for", "make_optimizer", "state_block", "state_bytes"]

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adamw_fp8", "adamw_bf16sr")

# torchao/optim/adam.py: each class's default block size, and the smallest tensor it quantizes.
_BLOCK = {"adamw8bit": 256, "adamw4bit": 128, "adamw_fp8": 256}
_MIN_QUANTIZED = 4096
# A block a row's divisor smaller than this fraction of the class's block is refused (full-precision
# state): each block carries a 4-byte scale, 1/8 of 256 is 32 elements, 0.125 B an element.
_MIN_BLOCK_FRACTION = 8


def _torchao_class(name: str) -> type[torch.optim.Optimizer]:
    # Imported here: torchao is optional for a user of plain AdamW, and its import is slow.
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8, _AdamW

    base = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit, "adamw_fp8": AdamWFp8, "adamw_bf16sr": _AdamW}[name]
    if base not in _UNCACHED:
        mixins = (_NoAutogradCache,) if base is _AdamW else (_NoAutogradCache, _RowBlocks)
        # Same class name as torchao's: checkpoints and logs name the optimizer the user chose.
        _UNCACHED[base] = type(base.__name__, (*mixins, base), {"__module__": __name__, "_base": base})
    return _UNCACHED[base]


def block_for(shape: Sequence[int], block: int) -> int | None:
    """The block a quantized state of a parameter of global ``shape`` uses, or None (full precision).

    Decided on the global shape, so every mesh decides alike. Blocks divide the row (the elements
    of one index of dim 0), so FSDP2's row shards split no block: 2+ dims, at least 4096 elements,
    and the class's ``block`` if it divides the row, else the row's largest even divisor below it,
    if that is at least ``block / 8`` (each block costs a 4-byte scale).
    """
    numel = math.prod(shape)
    if len(shape) < 2 or numel < _MIN_QUANTIZED:
        return None
    row = numel // shape[0]
    b = next((d for d in range(min(block, row), 0, -1) if row % d == 0 and d % 2 == 0), None)
    return b if b is not None and b * _MIN_BLOCK_FRACTION >= block else None


class _RowBlocks:
    """torchao's low-bit AdamW with the quantize decision and block taken from the global shape.

    Replaces ``_AdamBase._new_buffer`` (torchao 0.18), which decides on the local shard; see the
    module docstring and `block_for`. The state's own classes read the block back from their
    codes and scales, so a per-parameter block needs nothing else.
    """

    block_size: int

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        local = _local(p)
        block = block_for(p.shape, self.block_size)
        placements = p.placements if isinstance(p, DTensor) else ()
        if block is not None and any(isinstance(pl, Shard) and pl.dim != 0 for pl in placements):
            # a tensor-parallel shard of dim 1+: blocks must divide its local rows too (not mesh-independent)
            local_row = local.numel() // max(local.shape[0], 1) if local.dim() else 0
            block = block if local_row % block == 0 else None
        if block is None or local.numel() == 0:  # an empty shard (fewer rows than ranks) has no block
            out = torch.zeros_like(local)
        else:
            out = self._subclass_zeros(local, signed, block)
        if isinstance(p, DTensor):  # as torchao does: shards may differ in shape, so give the global one
            out = DTensor.from_local(
                out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return out.to(p.device)  # from_local moves to the mesh's device; a CPU-offloaded p stays on the host


class _NoAutogradCache:
    """torchao's step with AOTAutograd's on-disk cache off, in the step's scope only.

    torchao compiles each parameter's update. Its state classes (OptimState8bit, ...) define no
    ``_stable_hash_for_caching``, and AOTAutograd's cache (torch 2.13) then keys a DTensor-wrapped
    state by its outer shape: a 128 x 128 parameter sharded 64 x 128 on one mesh and whole on
    another (a resume at another world, or the single-process reference beside the sharded run)
    share an entry, and the cached kernel fails its size check ("wrong number of dimensions").
    Inductor's own graph cache, keyed by the traced graph, stays on.
    """

    _base: type[torch.optim.Optimizer]

    @torch.no_grad()
    def step(self, closure=None):
        step = self._base.step
        if getattr(step, "hooked", False):  # torch wrapped it for step hooks, which this class's step already runs
            step = step.__wrapped__
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return step(self, closure)


_UNCACHED: dict[type, type] = {}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def state_block(name: str, shape: Sequence[int], block: int | None = None) -> int | None:
    """The block of optimizer ``name``'s quantized state for a parameter of global ``shape``, or None
    (full-precision state, or not a low-bit optimizer): `block_for` with the class's default block."""
    return block_for(shape, block or _BLOCK[name]) if name in _BLOCK else None


def state_bytes(numel: int, dtype: torch.dtype, name: str, shape: Sequence[int], *, block: int | None = None) -> int:
    """Bytes of optimizer state ``name`` keeps for one local tensor of ``numel`` elements in ``dtype``,
    a shard of a parameter of global ``shape`` (from which `make_optimizer` decides: `state_block`).

    Follows the classes' own allocation: torch AdamW's exp_avg and exp_avg_sq like the parameter;
    for each of torchao's two states, 8-bit/FP8 codes (1 B) or 4-bit codes (two a byte), one fp32
    scale a block, and the code table each 8-bit (256 fp32) or 4-bit (16 fp32) state carries, or a
    pair like the parameter where it is not quantized. The 0-d ``step`` is not counted.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: expected one of {list(OPTIMIZERS)}")
    block = state_block(name, shape, block)
    if block is None or numel == 0:
        return 2 * numel * dtype.itemsize
    codes = numel // 2 if name == "adamw4bit" else numel
    table = {"adamw8bit": 256, "adamw4bit": 16, "adamw_fp8": 0}[name] * 4
    return 2 * (codes + 4 * (numel // block) + table)


def make_optimizer(
    model: nn.Module,
    name: str = "adamw",
    *,
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    offload: bool = False,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """An AdamW over ``model``'s trainable parameters, chosen by ``name`` (see the module docstring).

    Args:
        model: the model after `shard_model` (its parameters are the DTensor shards) and after
            its weights are filled; a plain module works too.
        name: one of ``OPTIMIZERS``.
        lr, weight_decay, betas, eps: AdamW's hyper-parameters (decoupled weight decay).
        offload: keep AdamW's state (and its step) in pinned host memory, parameters and gradients
            on the GPU (`fsdp2kit.optim_offload.OffloadedAdamW`); ``adamw`` over CUDA parameters
            only: on CPU there is no device/host split to make (ValueError).
        kwargs: passed to the optimizer class: torch.optim.AdamW's (``fused``, ``foreach``, ...)
            or torchao's (``block_size``, ``bf16_stochastic_round``).

    Raises:
        ValueError: an unknown name; a model with no trainable parameter; ``adamw_bf16sr`` over
            parameters that are not bf16; ``offload`` with another name than ``adamw``, or over
            parameters that are not on a CUDA device.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("make_optimizer: the model has no trainable parameter (requires_grad=True)")
    params = [p for _, p in named]
    hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if offload:
        return _offloaded(named, name, hyper, kwargs)
    if name == "adamw":
        low = [n for n, p in named if p.dtype in (torch.bfloat16, torch.float16)]
        if low:  # pure_bf16 chosen, but with round-to-nearest updates: say so rather than switch silently
            warnings.warn(
                f"make_optimizer('adamw'): {len(low)} trainable parameter(s) are 16-bit (e.g. {low[0]}): torch's "
                "AdamW rounds each update to the nearest representable value, so updates under half a step "
                "of that dtype are lost. 'adamw_bf16sr' rounds them stochastically (bf16); fp32 master "
                "weights (mixed_precision='bf16') keep them.",
                stacklevel=2,
            )
        return torch.optim.AdamW(params, **hyper, **kwargs)

    bf16 = [n for n, p in named if p.dtype == torch.bfloat16]
    if name == "adamw_bf16sr":
        other = [f"{n} ({str(p.dtype).removeprefix('torch.')})" for n, p in named if p.dtype != torch.bfloat16]
        if other:
            raise ValueError(
                f"optimizer 'adamw_bf16sr' steps bf16 parameters with stochastic rounding, but {len(other)} "
                f"trainable parameter(s) are not bf16, e.g. {', '.join(other[:3])}: shard with "
                "mixed_precision='pure_bf16', or choose 'adamw' to keep fp32 master weights"
            )
        kwargs.setdefault("bf16_stochastic_round", True)
    elif bf16:  # a round-to-nearest bf16 update smaller than half a bf16 step would be lost
        kwargs.setdefault("bf16_stochastic_round", True)
    return _torchao_class(name)(params, **hyper, **kwargs)


def _offloaded(named: list[tuple[str, torch.Tensor]], name: str, hyper: dict, kwargs: dict) -> torch.optim.Optimizer:
    from fsdp2kit.optim_offload import OffloadedAdamW

    if name != "adamw":
        raise ValueError(
            f"make_optimizer({name!r}, offload=True): state offload is for 'adamw' (its fp32 state is what "
            "offload moves; a low-bit state is already 4-8x smaller and its step is compiled for the device)"
        )
    off = [f"{n} ({_local(p).device})" for n, p in named if _local(p).device.type != "cuda"]
    if off:
        raise ValueError(
            f"make_optimizer(offload=True) keeps parameters and gradients on the GPU and the optimizer state in "
            f"host memory, but {len(off)} trainable parameter(s) are not on a CUDA device, e.g. {', '.join(off[:2])}: "
            "on CPU there is nothing to offload (use offload=False); shard_model(..., cpu_offload=True) moves "
            "parameters, gradients and state to the host together"
        )
    if kwargs:
        raise ValueError(
            f"make_optimizer(offload=True) takes AdamW's lr, betas, eps, weight_decay only, not {sorted(kwargs)}"
        )
    return OffloadedAdamW([p for _, p in named], **hyper)
