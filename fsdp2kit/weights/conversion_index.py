"""Whether a checkpoint needs none of transformers' weight conversions, without building their whole table.

transformers keeps one table of weight conversions (renamings, expert fusing, transposes) keyed
by model class name or ``model_type``; its first use in a process builds every model's entries,
about a thousand regular expressions compiled, which on a CPU was the largest single cost of a
small model's load (about 0.16 s, in `from_pretrained` too). A checkpoint whose keys are all
the model's own keys needs none of it when no class or ``model_type`` of the model has an entry
and none of the "legacy" renamings (applied to every model) matches a key: then every
conversion leaves every key and tensor as it is.

The facts needed for that decision (the table's keys, the legacy renamings' compiled patterns)
are remembered in a small JSON file per transformers installation (its version and the size
and mtime of its ``conversion_mapping.py``), written the first time a process builds the table.
The file lives in ``$FSDP2KIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fsdp2kit``, else
``~/.cache/fsdp2kit``; ``FSDP2KIT_CACHE_DIR=""`` turns it off (every load then builds the
table, as before). A table already built in this process is used directly, so conversions a
user registers (``register_checkpoint_conversion_mapping``) are always seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch.nn as nn

from fsdp2kit.weights.hf_layout import is_pretrained, original_class


def cache_dir() -> Path | None:
    configured = os.environ.get("FSDP2KIT_CACHE_DIR")
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fsdp2kit"


def _index_file() -> Path | None:
    directory = cache_dir()
    if directory is None or "transformers" not in sys.modules:
        return None
    import transformers
    from transformers import conversion_mapping

    st = os.stat(conversion_mapping.__file__)
    return directory / f"transformers-{transformers.__version__}-conversions-{st.st_size}-{st.st_mtime_ns}.json"


def _from_table(table: dict) -> dict:
    legacy = [t.compiled_sources.pattern for t in table.get("legacy") or []]
    return {"keys": sorted(table), "legacy": legacy}


def loaded_table() -> dict | None:
    """transformers' conversion table if this process has built it already, else None."""
    mod = sys.modules.get("transformers.conversion_mapping")
    return getattr(mod, "_checkpoint_conversion_mapping_cache", None) if mod is not None else None


def known_index(*, use_loaded: bool = True) -> dict | None:
    """{"keys": the table's keys, "legacy": its legacy patterns}, from this process or the file; or None."""
    table = loaded_table() if use_loaded else None
    if table is not None:
        return _from_table(table)
    path = _index_file()
    if path is None or not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not all(isinstance(index.get(k), list) for k in ("keys", "legacy")):
        return None
    return index


def remember_index() -> None:
    """Write the index file from the table this process built; a cache, so any failure is ignored."""
    table, path = loaded_table(), _index_file()
    if table is None or path is None or path.is_file():
        return
    tmp = None
    try:
        text = json.dumps(_from_table(table))
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            f.write(text)
        os.replace(tmp, path)  # atomic: ranks writing at once leave one whole file
    except (OSError, AttributeError, TypeError):
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def needs_no_conversion(model: nn.Module, disk_keys, model_keys) -> bool:
    """True only when transformers' conversions provably leave every checkpoint key and tensor as it is."""
    if not is_pretrained(model) or any(k not in model_keys for k in disk_keys):
        return False
    index = known_index()
    if index is None:
        return False
    from transformers.conversion_mapping import USER_REGISTERED_MAPPINGS

    keys = set(index["keys"]) | set(USER_REGISTERED_MAPPINGS)
    for m in model.modules():
        if is_pretrained(m):
            config = getattr(m, "config", None)
            names = {original_class(m).__name__, getattr(config, "model_type", None)}
            if names & keys:
                return False
    try:
        legacy = [re.compile(p) for p in index["legacy"]]
    except (re.error, TypeError):
        return False
    return not any(p.search(k) for p in legacy for k in disk_keys)
