"""`convert_config`: read an Accelerate YAML or a DeepSpeed JSON file and convert it for the recipe."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp2kit.migrate.accelerate import convert_accelerate
from fsdp2kit.migrate.conversion import ConfigConversionError, Conversion
from fsdp2kit.migrate.deepspeed import convert_deepspeed

__all__ = ["convert_config"]


def convert_config(path: str | os.PathLike, *, source: str | None = None) -> Conversion:
    """Convert an ``accelerate config`` YAML or a DeepSpeed config JSON into recipe settings.

    ``source`` is ``"accelerate"`` or ``"deepspeed"``; by default ``.json`` files are DeepSpeed's
    and anything else is read as Accelerate YAML (Accelerate also writes JSON configs: pass
    ``source="accelerate"`` for those). The returned `Conversion` accounts for every key:
    ``conv.to_toml()`` is the recipe config, ``conv.command()`` the torchrun line, and
    ``conv.refused`` the keys that have no FSDP2 counterpart (each with the alternative).
    """
    import yaml  # PyYAML, a dependency of transformers (and of ours); imported here, not at `import fsdp2kit`

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    text = path.read_text()
    is_json = path.suffix.lower() == ".json"
    kind = (source or ("deepspeed" if is_json else "accelerate")).lower()
    if kind not in ("accelerate", "deepspeed"):
        raise ValueError(f"source={source!r}: expected 'accelerate' or 'deepspeed'")
    parse, error, form = (json.loads, ValueError, "JSON") if is_json else (yaml.safe_load, yaml.YAMLError, "YAML")
    try:
        data = parse(text)
    except error as e:
        raise ConfigConversionError(f"{path} is not valid {form}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigConversionError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    if kind == "deepspeed":
        if "distributed_type" in data or "fsdp_config" in data:
            raise ConfigConversionError(f"{path} looks like an Accelerate config: pass source='accelerate'")
        return convert_deepspeed(data, str(path)).finish()
    if "distributed_type" not in data and ("zero_optimization" in data or "train_batch_size" in data):
        raise ConfigConversionError(
            f"{path} looks like a DeepSpeed config (zero_optimization): pass source='deepspeed'"
        )
    return convert_accelerate(data, str(path)).finish()
