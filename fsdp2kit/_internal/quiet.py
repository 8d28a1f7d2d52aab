"""Two known-harmless import-time warnings kept out of fsdp2kit's own calls and scripts (docs/internals.md)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

_MESSAGES = (
    ("torchao", ("Failed to load",)),
    ("torch.utils._pytree", ("is an Enum subclass and is now natively supported",)),
)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Inside (this thread's records only): torchao's import-time lines above are dropped."""
    thread = threading.get_ident()
    installed = []
    for name, fragments in _MESSAGES:

        def keep(record: logging.LogRecord, fragments=fragments) -> bool:
            return record.thread != thread or not any(f in record.getMessage() for f in fragments)

        installed.append((logging.getLogger(name), keep))
    for logger, f in installed:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in installed:
            logger.removeFilter(f)
