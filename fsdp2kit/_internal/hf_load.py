"""transformers' ``from_pretrained``, called so that it cannot leave ``torch.device(...)`` contexts broken.

transformers (5.x) builds the model under ``torch.device("meta")`` with ``torch.linspace`` patched
(``transformers.initialization.meta_device_safe_creation_ops``). torch fills the table of factory
functions a device context redirects the first time any device context sees a call
(``torch.utils._device._device_constructors``, an ``lru_cache``). When that first time is inside
``from_pretrained``, the table keeps transformers' temporary wrapper instead of ``torch.linspace``,
and for the rest of the process ``torch.linspace`` ignores every ``torch.device(...)`` context: a
model built under ``torch.device("meta")`` gets real CPU buffers where it should get meta ones.
Using a device context once beforehand fills the table with torch's own functions, exactly what
torch would put there itself, so the library's call leaves the process as the user had it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["from_pretrained"]


def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``cls.from_pretrained(*args, **kwargs)``, with torch's device-context table filled first."""
    with torch.device("meta"):
        torch.empty(0)  # fills the table (if it is filled already, this changes nothing)
    return cls.from_pretrained(*args, **kwargs)
