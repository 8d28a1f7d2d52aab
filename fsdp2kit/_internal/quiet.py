"""Keep two known-harmless import-time warnings out of the output of fsdp2kit's own calls and scripts.

How it works and why: docs/internals.md, section fsdp2kit/_internal/quiet.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

__all__ = ["quiet_imports"]

_MESSAGES = (
    ("torchao", ("Failed to load",)),
    ("torch.utils._pytree", ("is an Enum subclass and is now natively supported",)),
)


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Inside (this thread's records only): torchao's import-time lines above are dropped."""
    installed = [(logging.getLogger(name), _DropMessages(fragments)) for name, fragments in _MESSAGES]
    for logger, f in installed:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in installed:
            logger.removeFilter(f)
