"""The one place fsdp2kit changes other code's functions: for its own call on its own thread (docs/internals.md)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

_lock = threading.Lock()
_TABLE = "_fsdp2kit_diverted"  # on a stand-in: {thread id: [replacements, innermost last]}


@contextlib.contextmanager
def divert(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Inside: this thread's calls to ``owner.name`` run ``replacement(original, *args, **kwargs)``, other
    threads' the original. Blocks nest; the original goes back when the last one closes."""
    me = threading.get_ident()
    with _lock:
        current = getattr(owner, name)
        table = getattr(current, _TABLE, None)
        if table is None:
            original, table = current, {}

            @functools.wraps(original)
            def stand_in(*args, **kwargs):
                stack = table.get(threading.get_ident())
                return stack[-1](*args, **kwargs) if stack else original(*args, **kwargs)

            setattr(stand_in, _TABLE, table)
            stand_in._fsdp2kit_original = original
            setattr(owner, name, stand_in)
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
            if not table and getattr(owner, name) is stand_in:
                setattr(owner, name, original)
