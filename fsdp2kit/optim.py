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

torchao's low-bit states are quantized per *local shard* (so whether a small parameter's state is
quantized depends on the mesh: `make_optimizer` warns, naming them), and with bf16 parameters its
updates are rounded stochastically from each rank's RNG stream: docs/optimizers.md says why and
what the tests bound.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["OPTIMIZERS", "make_optimizer", "state_bytes"]

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adamw_fp8", "adamw_bf16sr")

# torchao/optim/adam.py: each class's default block size, and the smallest tensor it quantizes.
_BLOCK = {"adamw8bit": 256, "adamw4bit": 128, "adamw_fp8": 256}
_MIN_QUANTIZED = 4096


def _torchao_class(name: str) -> type[torch.optim.Optimizer]:
    # Imported here: torchao is optional for a user of plain AdamW, and its import is slow.
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8, _AdamW

    base = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit, "adamw_fp8": AdamWFp8, "adamw_bf16sr": _AdamW}[name]
    if base not in _UNCACHED:
        # Same class name as torchao's: checkpoints and logs name the optimizer the user chose.
        _UNCACHED[base] = type(base.__name__, (_NoAutogradCache, base), {"__module__": __name__, "_base": base})
    return _UNCACHED[base]


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


def quantized(numel: int, block: int) -> bool:
    """Whether torchao keeps a low-bit state for a (local) tensor of ``numel`` elements."""
    return numel >= _MIN_QUANTIZED and numel % block == 0


def state_bytes(numel: int, dtype: torch.dtype, name: str, *, block: int | None = None) -> int:
    """Bytes of optimizer state ``name`` keeps for one local tensor of ``numel`` elements in ``dtype``.

    Follows the classes' own allocation: torch AdamW's exp_avg and exp_avg_sq like the parameter;
    for each of torchao's two states, 8-bit/FP8 codes (1 B) or 4-bit codes (two a byte), one fp32
    scale a block, and the code table each 8-bit (256 fp32) or 4-bit (16 fp32) state carries, or a
    pair like the parameter below the quantizing threshold. The 0-d ``step`` is not counted.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: expected one of {list(OPTIMIZERS)}")
    block = block or _BLOCK.get(name)
    if block is None or not quantized(numel, block):
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
        offload: keep the optimizer state in host memory. Not available yet: raises
            NotImplementedError (torchao's ``CPUOffloadOptimizer`` runs on CUDA/XPU only, takes
            one plain tensor per parameter rather than FSDP2's DTensor shards, and its state dict
            is not the one DCP reshards).
        kwargs: passed to the optimizer class: torch.optim.AdamW's (``fused``, ``foreach``, ...)
            or torchao's (``block_size``, ``bf16_stochastic_round``).

    Raises:
        ValueError: an unknown name; a model with no trainable parameter; ``adamw_bf16sr`` over
            parameters that are not bf16.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")
    if offload:
        raise NotImplementedError(
            "make_optimizer(offload=True): optimizer-state offload is not available yet. torchao's "
            "CPUOffloadOptimizer runs on CUDA/XPU only, copies each parameter as one plain tensor (not "
            "FSDP2's DTensor shard), and saves a state dict DCP cannot reshard; nothing here has been "
            "verified on a GPU. Use shard_model(..., cpu_offload=True) to keep parameters, gradients and "
            "state on the host, or a low-bit optimizer (adamw8bit, adamw4bit) to shrink the state."
        )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("make_optimizer: the model has no trainable parameter (requires_grad=True)")
    params = [p for _, p in named]
    hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
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
    else:
        if bf16:  # a round-to-nearest bf16 update smaller than half a bf16 step would be lost
            kwargs.setdefault("bf16_stochastic_round", True)
        _warn_unquantized(named, name, kwargs.get("block_size", _BLOCK[name]))
    return _torchao_class(name)(params, **hyper, **kwargs)


def _warn_unquantized(named: list[tuple[str, torch.Tensor]], name: str, block: int) -> None:
    """Warn about parameters whose state torchao would quantize unsharded but not on this rank's shard."""
    lost = [n for n, p in named if quantized(p.numel(), block) and not quantized(_local(p).numel(), block)]
    if lost:
        warnings.warn(
            f"make_optimizer({name!r}): {len(lost)} parameter(s) keep a full-precision state on this rank "
            f"because their local shard is under {_MIN_QUANTIZED} elements or not a multiple of the block "
            f"({block}), though the whole tensor would be quantized: {', '.join(lost[:4])}"
            f"{' ...' if len(lost) > 4 else ''}. Their state costs 4-8x the bytes the planner counts; a mesh "
            "whose shard sizes are multiples of the block avoids it.",
            stacklevel=2,
        )
