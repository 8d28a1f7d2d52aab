"""Drop two known-harmless import-time warnings from users' output, and nothing else.

- torchao (imported by transformers) tries to load its CUDA-only kernels and logs one
  "Failed to load ..._C_*.so" line per library on a CPU build.
- torchao registers Enum classes with torch's pytree, which logs a deprecation per class.

Both are printed on every rank at every start and bury the lines that matter. The filters match
those messages exactly, so any other warning from the same loggers still gets through. They only
act on imports that happen after fsdp2kit is imported.
"""

from __future__ import annotations

import logging


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def _install() -> None:
    for name, fragments in (
        ("torchao", ("Failed to load",)),
        ("torch.utils._pytree", ("is an Enum subclass and is now natively supported",)),
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(*fragments))


_install()
