"""Constructing a model whose parameters live on the meta device without initialising them.

On the meta device an init function computes nothing, yet it is not free: transformers'
``post_init`` runs ``_init_weights`` over every module and each ``nn.Linear`` runs
``reset_parameters``, every call going through torch's Python decompositions. For a 34M-parameter
Llama on one CPU core that was about a third of `load_pretrained`'s time, which builds such
models twice (benchmarks/results/peers.md). Two switches skip it, for meta tensors only:

- transformers' init functions skip a tensor that carries its ``_is_hf_initialized`` flag (how
  its own ``from_pretrained`` skips the weights it is about to load): meta parameters get it;
- ``torch.nn.init``'s functions return a meta tensor untouched.

Buffers are not skipped: ``_init_weights`` still computes them (rotary ``inv_freq`` is set
there), so their values are what an ordinary construction gives. (transformers' own
``no_init_weights`` skips ``init_weights`` as a whole, buffers included, so it does not serve.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn as nn

from fsdp2kit._internal.markers import HF_INITIALIZED

__all__ = ["flag_meta_parameter", "meta_tensors_skip_torch_init", "skip_meta_parameter_init"]

# torch.nn.init's in-place initialisers: each takes the tensor first.
_TORCH_INITS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


def flag_meta_parameter(param: nn.Parameter | None, flagged: list | None = None) -> None:
    """Mark a meta parameter so that transformers' init functions leave it alone."""
    if param is not None and param.is_meta and not getattr(param, HF_INITIALIZED, False):
        setattr(param, HF_INITIALIZED, True)
        if flagged is not None:
            flagged.append(param)


@contextlib.contextmanager
def meta_tensors_skip_torch_init() -> Iterator[None]:
    """Inside: ``torch.nn.init.<fn>_(t, ...)`` returns ``t`` at once when ``t`` is on the meta device."""
    originals = {name: getattr(torch.nn.init, name) for name in _TORCH_INITS if hasattr(torch.nn.init, name)}

    def skipping(fn):
        @functools.wraps(fn)
        def init(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return fn(tensor, *args, **kwargs)

        return init

    for name, fn in originals.items():
        setattr(torch.nn.init, name, skipping(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.nn.init, name, fn)


@contextlib.contextmanager
def skip_meta_parameter_init() -> Iterator[None]:
    """Inside: meta parameters registered on any module are initialised by neither transformers nor torch.

    On the way out the flags are removed again: the model handed to the user carries nothing of
    ours, and an init run later on these very Parameter objects is not skipped.
    """
    register = nn.Module.register_parameter
    flagged: list[nn.Parameter] = []

    def register_flagged(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        flag_meta_parameter(param, flagged)
        register(self, name, param)

    nn.Module.register_parameter = register_flagged
    try:
        with meta_tensors_skip_torch_init():
            yield
    finally:
        nn.Module.register_parameter = register
        for param in flagged:
            with contextlib.suppress(AttributeError):
                delattr(param, HF_INITIALIZED)
