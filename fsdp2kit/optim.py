"""make_optimizer: an AdamW by name, full precision or low-precision state (README.md, "Optimizer state and precision";
why low-bit blocks follow each parameter's global shape, pytorch/ao#4912: docs/optimizers.md)."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fsdp2kit._internal.dtensor import local_shard
from fsdp2kit.optim_offload import OffloadedAdamW

__all__ = ["OPTIMIZERS", "block_for", "make_optimizer", "state_block", "state_bytes"]

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adamw_fp8", "adamw_bf16sr")

# torchao/optim/adam.py: each class's default block size, and the smallest tensor it quantizes.
_BLOCK = {"adamw8bit": 256, "adamw4bit": 128, "adamw_fp8": 256}
_MIN_QUANTIZED = 4096
# A block a row's divisor smaller than this fraction of the class's block is refused (full-precision
# state): each block carries a 4-byte scale, 1/8 of 256 is 32 elements, 0.125 B an element.
_MIN_BLOCK_FRACTION = 8


@functools.cache
def _torchao_class(name: str) -> type[torch.optim.Optimizer]:
    # Imported here: torchao is optional for a user of plain AdamW, and its import is slow.
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8, _AdamW

    base = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit, "adamw_fp8": AdamWFp8, "adamw_bf16sr": _AdamW}[name]
    mixins = (_NoAutogradCache,) if base is _AdamW else (_NoAutogradCache, _RowBlocks)
    # Same class name as torchao's: checkpoints and logs name the optimizer the user chose.
    return type(base.__name__, (*mixins, base), {"__module__": __name__, "_base": base})


def block_for(shape: Sequence[int], block: int) -> int | None:
    """The block a quantized state of a parameter of global ``shape`` uses, or None (full precision): a
    divisor of the row (dim 0's elements), so FSDP2's row shards split no block (docs/optimizers.md)."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel < _MIN_QUANTIZED:
        return None
    row = numel // shape[0]
    b = next((d for d in range(min(block, row), 0, -1) if row % d == 0 and d % 2 == 0), None)
    return b if b is not None and b * _MIN_BLOCK_FRACTION >= block else None


class _RowBlocks:
    """torchao's low-bit AdamW with ``_AdamBase._new_buffer`` (torchao 0.18) deciding from the global shape
    (`block_for`), not the local shard; the state classes read each parameter's block back from its scales."""

    block_size: int

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        local = local_shard(p)
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
    """torchao's step with AOTAutograd's on-disk cache off, in the step's scope only: the cache keys a
    DTensor-wrapped state by its outer shape, so shards of other meshes collide (docs/optimizers.md)."""

    _base: type[torch.optim.Optimizer]

    @torch.no_grad()
    def step(self, closure=None):
        step = self._base.step
        if getattr(step, "hooked", False):  # torch wrapped it for step hooks, which this class's step already runs
            step = step.__wrapped__
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return step(self, closure)


def state_block(name: str, shape: Sequence[int]) -> int | None:
    """The block of optimizer ``name``'s quantized state for a parameter of global ``shape``, or None
    (full-precision state, or not a low-bit optimizer): `block_for` with the class's default block."""
    return block_for(shape, _BLOCK[name]) if name in _BLOCK else None


def state_bytes(numel: int, dtype: torch.dtype, name: str, shape: Sequence[int]) -> int:
    """Bytes of optimizer state ``name`` for a local shard of ``numel`` elements in ``dtype`` of a parameter of global
    ``shape``: the classes' own allocation, both states' codes, fp32 scales and code table (not the 0-d step)."""
    block = state_block(name, shape)
    if block is None or numel == 0:
        return 2 * numel * dtype.itemsize
    codes = numel // 2 if name == "adamw4bit" else numel
    table = {"adamw8bit": 256, "adamw4bit": 16, "adamw_fp8": 0}[name] * 4
    return 2 * (codes + 4 * (numel // block) + table)


def _on_host_of_accelerator(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and p.device_mesh.device_type != "cpu" and local_shard(p).device.type == "cpu"


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
    """An AdamW over ``model``'s trainable parameters, chosen by ``name`` (one of `OPTIMIZERS`).

    Call it after `shard_model` and after the weights are filled (it must see the DTensor shards); a plain
    module works too. ``lr``, ``weight_decay``, ``betas``, ``eps``: AdamW's (decoupled weight decay).
    ``offload``: AdamW's state and step in pinned host memory, parameters and gradients on the GPU
    (`fsdp2kit.optim_offload.OffloadedAdamW`; ``adamw`` over CUDA parameters only, else ValueError).
    ``kwargs`` go to the class: torch.optim.AdamW's (``fused``, ...) or torchao's (``block_size``, ...); for
    ``adamw`` over host shards on a GPU mesh (``shard_model(cpu_offload=True)``) ``fused=True`` unless given.
    Raises ValueError for an unknown name, no trainable parameter, or ``adamw_bf16sr`` over non-bf16 ones.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("make_optimizer: the model has no trainable parameter (requires_grad=True)")
    params = [p for _, p in named]
    hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if offload:
        if name != "adamw":
            raise ValueError(
                f"make_optimizer({name!r}, offload=True): state offload is for 'adamw' (its fp32 state is what "
                "offload moves; a low-bit state is already 4-8x smaller and its step is compiled for the device)"
            )
        off = [f"{n} ({local_shard(p).device})" for n, p in named if local_shard(p).device.type != "cuda"]
        if off:
            raise ValueError(
                "make_optimizer(offload=True) keeps parameters and gradients on the GPU and the optimizer state in "
                f"host memory, but {len(off)} trainable parameter(s) are not on a CUDA device, e.g. "
                f"{', '.join(off[:2])}: on CPU there is nothing to offload (use offload=False); "
                "shard_model(..., cpu_offload=True) moves parameters, gradients and state to the host together"
            )
        if kwargs:
            raise ValueError(
                f"make_optimizer(offload=True) takes AdamW's lr, betas, eps, weight_decay only, not {sorted(kwargs)}"
            )
        return OffloadedAdamW(params, **hyper)
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
        if "fused" not in kwargs and "foreach" not in kwargs and all(map(_on_host_of_accelerator, params)):
            # shard_model(cpu_offload=True): torch picks its single-tensor loop for CPU parameters, ~7x slower
            # than its fused CPU kernel (docs/optimizers.md, "Offload"); on a CPU mesh torch's choice stays
            kwargs["fused"] = True
        return torch.optim.AdamW(params, **hyper, **kwargs)

    if name == "adamw_bf16sr":
        other = [f"{n} ({str(p.dtype).removeprefix('torch.')})" for n, p in named if p.dtype != torch.bfloat16]
        if other:
            raise ValueError(
                f"optimizer 'adamw_bf16sr' steps bf16 parameters with stochastic rounding, but {len(other)} "
                f"trainable parameter(s) are not bf16, e.g. {', '.join(other[:3])}: shard with "
                "mixed_precision='pure_bf16', or choose 'adamw' to keep fp32 master weights"
            )
    if any(p.dtype == torch.bfloat16 for p in params):  # round-to-nearest would lose updates under half a bf16 step
        kwargs.setdefault("bf16_stochastic_round", True)
    return _torchao_class(name)(params, **hyper, **kwargs)
