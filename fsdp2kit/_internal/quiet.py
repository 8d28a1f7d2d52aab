"""Two known-harmless import-time warnings kept out of fsdp2kit's own calls and scripts (docs/internals.md)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

_LOGGERS = ("torchao", "torch.utils._pytree")
_FRAGMENTS = ("Failed to load", "is an Enum subclass and is now natively supported")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Inside (this thread's records only): torchao's import-time lines above are dropped."""
    thread = threading.get_ident()

    def keep(record: logging.LogRecord) -> bool:
        return record.thread != thread or not any(f in record.getMessage() for f in _FRAGMENTS)

    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)
