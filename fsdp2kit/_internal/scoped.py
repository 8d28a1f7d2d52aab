"""The one place fsdp2kit changes other code's functions: only for its own call, only on its own thread.

How it works and why: docs/internals.md, section fsdp2kit/_internal/scoped.py.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_lock = threading.Lock()
_TABLE = "_fsdp2kit_diverted"  # on a stand-in: {thread id: [replacements, innermost last]}

# torch.nn.init's in-place initialisers (each takes the tensor first), and the modules that bind
# some of them by name at import (MultiheadAttention's xavier_uniform_...): transformers' list too.
INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
_INIT_MODULES = (
    "torch.nn.modules.activation", "torch.nn.modules.transformer", "torch.nn.modules.linear",
    "torch.nn.modules.loss", "torch.nn.modules.batchnorm", "torch.nn.modules.conv",
    "torch.nn.modules.normalization", "torch.nn.modules.rnn", "torch.nn.modules.sparse",
)  # fmt: skip


def _get(owner: Any, name: str) -> Any:
    return owner[name] if isinstance(owner, dict) else getattr(owner, name)


def _origin(fn: Any) -> Any:
    return getattr(fn, "_fsdp2kit_original", fn)


def _put(owner: Any, name: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:
        setattr(owner, name, value)


@contextlib.contextmanager
def divert(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Inside: this thread's calls to ``owner.name`` (``owner[name]`` for a dict) run
    ``replacement(original, *args, **kwargs)``; every other thread's calls run the original.

    Blocks nest (the inner replacement's ``original`` is the outer one) and may be open on
    several threads at once; the original goes back when the last one closes.
    """
    me = threading.get_ident()
    with _lock:
        current = _get(owner, name)
        table = getattr(current, _TABLE, None)
        if table is None:
            original, table = current, {}

            @functools.wraps(original)
            def stand_in(*args, **kwargs):
                stack = table.get(threading.get_ident())
                return stack[-1](*args, **kwargs) if stack else original(*args, **kwargs)

            setattr(stand_in, _TABLE, table)
            stand_in._fsdp2kit_original = original
            _put(owner, name, stand_in)
        else:
            stand_in, original = current, current._fsdp2kit_original
        stack = table.setdefault(me, [])
        below = stack[-1] if stack else original
        stack.append(functools.update_wrapper(functools.partial(replacement, below), original))
    try:
        yield
    finally:
        with _lock:
            stack.pop()
            if not stack:
                del table[me]
            if not table and _get(owner, name) is stand_in:
                _put(owner, name, original)


@contextlib.contextmanager
def divert_init_functions(replacement: Callable[..., Any]) -> Iterator[None]:
    """`divert` every ``torch.nn.init`` initialiser, where torch binds them and where transformers
    keeps its own references (``transformers.initialization.TORCH_INIT_FUNCTIONS``, which its
    init functions call), to ``replacement(original, tensor, *args, **kwargs)``."""
    if "transformers" in sys.modules:
        # Imported inside the block, it would keep our stand-ins as its references for good.
        import transformers.initialization  # noqa: F401
    init = torch.nn.init
    owners = [(init, name) for name in INIT_FUNCTIONS]
    for mod_name in _INIT_MODULES:
        mod = sys.modules.get(mod_name)
        for name in INIT_FUNCTIONS:
            if mod is not None and mod is not init and _origin(getattr(mod, name, None)) is _origin(_get(init, name)):
                owners.append((mod, name))
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict):
        owners += [(table, name) for name in table]
    with contextlib.ExitStack() as stack:
        for owner, name in owners:
            stack.enter_context(divert(owner, name, replacement))
        yield
