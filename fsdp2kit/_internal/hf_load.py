"""transformers' ``from_pretrained``, called so that it cannot leave ``torch.device(...)`` contexts broken
(docs/internals.md)."""

from __future__ import annotations

from typing import Any

import torch


def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``cls.from_pretrained(*args, **kwargs)``, with torch's device-context table filled first."""
    with torch.device("meta"):
        torch.empty(0)  # fills the table (if it is filled already, this changes nothing)
    return cls.from_pretrained(*args, **kwargs)
