"""What a library call must leave as it found it in the process: a snapshot, and the differences between two.

fsdp2kit's promise (docs/DESIGN: "what the library never does"): after any public call returns,
torch is as it was. `snapshot()` records everything process-wide that a call could change behind
the user's back; `differences(before, after)` names what changed, one line per item.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import random
import signal
import sys
import threading
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn as nn

# Loggers of the libraries fsdp2kit calls into, and their children that exist.
LOGGER_PREFIXES = ("torch", "torchao", "transformers", "peft", "accelerate")
# Modules whose attributes must be the very same objects afterwards (functions patched in place).
MODULES = (
    "torch", "torch.nn.init", "torch.nn.functional", "torch.nn.modules.activation", "torch.nn.modules.transformer",
    "torch.nn.modules.module", "torch.optim.optimizer", "torch.serialization", "torch.distributed",
    "torch.utils.checkpoint", "transformers.initialization", "transformers.masking_utils",
    "transformers.integrations.moe", "transformers.modeling_utils",
)  # fmt: skip
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


def _identities(namespace: dict) -> dict[str, int]:
    return {k: id(v) for k, v in namespace.items() if k != "__warningregistry__"}


def _logger_state(logger: logging.Logger) -> tuple:
    return (logger.level, logger.propagate, logger.disabled, tuple(logger.filters), tuple(logger.handlers))


def snapshot() -> dict[str, Any]:
    """Everything process-wide a call could change: RNG states, torch's global settings, patched
    functions, warning filters, other libraries' loggers, global hooks, mode stacks, signals."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    snap: dict[str, Any] = {
        "torch CPU RNG state": torch.get_rng_state(),
        "python random state": random.getstate(),
        "numpy RNG state": np.random.get_state(legacy=False),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.get_default_device()": torch.get_default_device(),
        "torch.serialization crc32": torch.serialization.get_crc32_options(),
        "torch.serialization config": torch.utils.serialization.config.get_config_copy(),
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_num_interop_threads()": torch.get_num_interop_threads(),
        "grad mode": (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
        "autocast": tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")),
        "deterministic algorithms": (
            torch.are_deterministic_algorithms_enabled(),
            torch.get_float32_matmul_precision(),
        ),
        "warnings.filters": list(warnings.filters),
        "torch function mode stack": [id(m) for m in torch.overrides._get_current_function_mode_stack()],
        "torch dispatch mode stack": [id(m) for m in _get_current_dispatch_mode_stack()],
        "optimizer global hooks": (
            list(optim_module._global_optimizer_pre_hooks),
            list(optim_module._global_optimizer_post_hooks),
        ),
        "nn.Module global hooks": {
            name: list(getattr(nn_module, name))
            for name in dir(nn_module)
            if name.startswith("_global_") and isinstance(getattr(nn_module, name), dict)
        },
        "torch.Tensor attributes": _identities(vars(torch.Tensor)),
        "nn.Module attributes": _identities(vars(nn.Module)),
        "nn.Parameter attributes": _identities(vars(nn.Parameter)),
        "signal handlers": {name: signal.getsignal(getattr(signal, name)) for name in SIGNALS},
        "os.environ": dict(os.environ),
        "atexit callbacks": atexit._ncallbacks(),
        "sys.excepthook": (sys.excepthook, threading.excepthook),
        "gc": (gc.isenabled(), gc.get_threshold()),
        "root logger": _logger_state(logging.getLogger()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        snap["torch CUDA RNG states"] = torch.cuda.get_rng_state_all()
    for name in MODULES:
        if name in sys.modules:
            snap[f"{name} attributes"] = _identities(vars(sys.modules[name]))
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    if table is not None:
        snap["transformers TORCH_INIT_FUNCTIONS"] = _identities(table)
    if "torch._dynamo" in sys.modules:
        snap["torch._dynamo.config"] = sys.modules["torch._dynamo"].config.get_config_copy()
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.split(".")[0] in LOGGER_PREFIXES:
            snap[f"logger {name}"] = _logger_state(logger)
    return snap


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _what(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        changed = sorted(str(k) for k in a.keys() | b.keys() if k not in a or k not in b or not _same(a[k], b[k]))
        return ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    text = f"{a!r} -> {b!r}"
    return text if len(text) < 300 else text[:300] + "..."


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per item that changed. A logger that first appears with torch's defaults (level
    NOTSET, propagating, no filters or handlers) is a library's lazy import, not a change."""
    out = []
    fresh = (logging.NOTSET, True, False, (), ())
    for key in before.keys() | after.keys():
        if key not in before:
            if key.startswith("logger ") and after[key] == fresh:
                continue
            if key.endswith(" attributes") or key in ("torch._dynamo.config", "transformers TORCH_INIT_FUNCTIONS"):
                continue  # a module imported by the call: nothing of it existed to change
            out.append(f"{key}: appeared")
        elif key not in after:
            out.append(f"{key}: disappeared")
        elif not _same(before[key], after[key]):
            if key.endswith(" attributes") and after[key].keys() >= before[key].keys():
                changed = [k for k in before[key] if before[key][k] != after[key][k]]
                if not changed:
                    continue  # only new names: a lazy submodule import, not a patch
                out.append(f"{key}: replaced {', '.join(sorted(changed)[:8])}")
            else:
                out.append(f"{key}: {_what(before[key], after[key])}")
    return sorted(out)
