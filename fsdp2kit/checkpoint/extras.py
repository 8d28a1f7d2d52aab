"""`extra`: user values stored as JSON text plus tensors (never a pickle), shared or per rank."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

try:  # numpy is optional: only its RNG state and arrays in `extra` need it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


@dataclass(slots=True, eq=False)  # by identity, as a plain class: its value may be a tensor
class PerRank:
    """Marks an ``extra`` value that differs by rank (a data-loader position): stored once per rank,
    each rank loads its own (plain values are rank 0's). Ranks that did not exist at save time keep
    their current value, with a warning. An `RNGState` is always per rank."""

    value: Any


class RNGState:
    """The calling process's random generators as a stateful object: torch CPU, every CUDA device
    (when CUDA is initialised), Python's ``random`` and NumPy's global generator. `Checkpointer`
    saves one per rank by default (``rng=True``); put one in ``extra`` to name it yourself."""

    def state_dict(self) -> dict:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "name": name,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():  # devices beyond this process's keep their state
            torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
        if "numpy" in state and np is not None:
            s = state["numpy"]
            np.random.set_state(
                (s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
            )


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _to_tree(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """``value`` as JSON-able data, tensors moved to ``tensors``; the tags: docs/checkpoint-format.md."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, DTensor):
        raise TypeError(
            f"{where} is a DTensor: sharded state belongs in the model or the optimizer, which are "
            "saved shard by shard; extra holds small replicated or per-rank values"
        )
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {"__tensor__": len(tensors) - 1}
    if np is not None and isinstance(value, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(value)).clone())
        return {"__ndarray__": len(tensors) - 1}
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_to_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        items = [(k, _to_tree(v, tensors, f"{where}[{k!r}]")) for k, v in value.items()]
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return dict(items)
        return {"__items__": [[_to_tree(k, tensors, f"{where} key"), v] for k, v in items]}
    hint = " (a nested object with state_dict(): put it at the top level of extra)" if is_stateful(value) else ""
    raise TypeError(
        f"{where} is a {type(value).__qualname__}, which a checkpoint does not store{hint}. extra takes "
        "JSON-able values (dict, list, tuple, str, int, float, bool, None), tensors, NumPy arrays, and "
        "top-level objects with state_dict()/load_state_dict()"
    )


def encode(value: Any, where: str) -> dict:
    """One ``extra`` entry as DCP leaves: {"json": uint8 tensor, "tensors": {"0": ..., ...}}."""
    tensors: list[torch.Tensor] = []
    if is_stateful(value):
        value = value.state_dict()
    text = json.dumps(_to_tree(value, tensors, where), allow_nan=True, separators=(",", ":"))
    entry: dict[str, Any] = {"json": torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)}
    if tensors:
        entry["tensors"] = {str(i): t for i, t in enumerate(tensors)}
    return entry


def decode(entry: dict) -> Any:
    tensors = entry.get("tensors", {})
    tags = {
        "__tensor__": lambda i: tensors[str(i)],
        "__ndarray__": lambda i: tensors[str(i)].numpy(),
        "__tuple__": tuple,
        "__items__": dict,
    }

    def untag(obj: dict) -> Any:  # json calls it innermost first: tagged values inside are decoded already
        tag = next(iter(obj)) if len(obj) == 1 else None
        return tags[tag](obj[tag]) if tag in tags else obj

    return json.loads(bytes(entry["json"].numpy()).decode(), object_hook=untag)


def templates(metadata: Metadata, prefix: tuple[str, ...]) -> dict:
    """The state saved under ``prefix`` (e.g. ("extra", "shared")), its tensors empty ones shaped after the
    metadata: what DCP fills in place on load."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}  # flat key -> nested path
    tree: dict = {}
    for flat, md in metadata.state_dict_metadata.items():
        path = tuple(str(p) for p in paths.get(flat, flat.split(".")))
        if path[: len(prefix)] == prefix and len(path) > len(prefix) and isinstance(md, TensorStorageMetadata):
            set_element(tree, path[len(prefix) :], torch.empty(tuple(md.size), dtype=md.properties.dtype))
    return tree


RNG_KEY = "__rng__"
