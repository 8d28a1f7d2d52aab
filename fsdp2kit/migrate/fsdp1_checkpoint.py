"""`load_fsdp1_checkpoint`: FSDP1 / Accelerate checkpoints (sharded DCP or full files) into an FSDP2 model
(how and why: docs/internals.md)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as dsd

from fsdp2kit._internal.agree import all_ranks_or_none
from fsdp2kit._internal.fmt import fmt_list, key_problems
from fsdp2kit.checkpoint.unpickler import SafeLoadPlanner, SafeReader, read_metadata
from fsdp2kit.migrate.full_state import ImportResult, load_full_state_dict, torch_load_safely
from fsdp2kit.weights.allocate import allocate_for_load
from fsdp2kit.weights.hf_layout import clean_fqn

__all__ = ["load_fsdp1_checkpoint"]

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"  # accelerate's FSDP_MODEL_NAME_{i}, OPTIMIZER_NAME_{i}
FULL_MODEL, FULL_OPTIM = "pytorch_model_fsdp.bin", "optimizer.bin"
ZERO_TO_FP32 = (
    "a DeepSpeed ZeRO checkpoint holds flat per-rank partitions: consolidate it first with the script DeepSpeed "
    "copied into it, `python {dir}/zero_to_fp32.py {dir} OUT_DIR --safe_serialization`, then load OUT_DIR "
    "with fk.load_full_state_dict (the optimizer state does not carry over)"
)


def _layout(path: Path) -> tuple[str, Path, Path | None]:
    """("dcp" | "full", where the model is, where the optimizer state is or None)."""
    if path.is_file():
        sibling = path.parent / FULL_OPTIM
        return "full", path, sibling if path.name == FULL_MODEL and sibling.is_file() else None
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / MODEL_DIR / ".metadata").is_file():
        optim = path / OPTIM_DIR
        return "dcp", path / MODEL_DIR, optim if (optim / ".metadata").is_file() else None
    if path.name == OPTIM_DIR:
        raise ValueError(f"{path} is Accelerate's optimizer directory: pass its parent (the save_state directory)")
    if (path / ".metadata").is_file():
        return "dcp", path, path
    if (path / FULL_MODEL).is_file():
        return _layout(path / FULL_MODEL)
    rank_files = sorted(p.name for p in path.glob("*_rank*.bin"))
    if rank_files:
        raise ValueError(
            f"{path} holds per-rank files ({fmt_list(rank_files, 4)}): Accelerate's use_dcp=False or "
            "LOCAL_STATE_DICT, which only the same world size under FSDP1 can read. Load it there and save again "
            "with fsdp_state_dict_type SHARDED_STATE_DICT (DCP) or FULL_STATE_DICT"
        )
    if (path / "latest").is_file() or list(path.glob("global_step*")) or list(path.glob("*optim_states.pt")):
        raise ValueError(ZERO_TO_FP32.format(dir=path))
    return "full", path, None


def _load_dcp_model(model: nn.Module, path: Path) -> int:
    with all_ranks_or_none(model, "load_fsdp1_checkpoint"):
        metadata = read_metadata(path)
        stored = set(metadata.state_dict_metadata)
        state = dsd.get_model_state_dict(model)
        prefix = next((p for p in ("model.", "") if all(p + k in stored for k in state)), None)
        best = prefix if prefix is not None else "model." if any(k.startswith("model.") for k in stored) else ""
        missing = sorted(k for k in state if best + k not in stored)
        extra = sorted(k[len(best) :] for k in stored if best and k.startswith(best) and k[len(best) :] not in state)
        problems = key_problems(missing, extra)
        if problems:
            raise ValueError(f"{path}: " + "; ".join(problems))
    # through the allow-list reader and planner: no pickled code in the directory runs
    dcp.load(
        {"model": state} if prefix else state, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner()
    )
    dsd.set_model_state_dict(model, state)
    return len(state)


def _load_dcp_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    state = dsd.get_optimizer_state_dict(model, optimizer)  # per-FQN, with the state the optimizer will have
    with all_ranks_or_none(model, "load_fsdp1_checkpoint"):
        metadata = read_metadata(path)
        stored = set(metadata.state_dict_metadata)
        prefix = next((p for p in ("optimizer", "optim") if any(k.startswith(f"{p}.state.") for k in stored)), None)
        if prefix is None:
            raise ValueError(f"{path} holds no optimizer state (no optimizer.state.* keys)")
        wanted = [f"{prefix}.state.{fqn}.{name}" for fqn, entries in state["state"].items() for name in entries]
        missing = [k for k in wanted if k not in stored]
        if missing:
            raise ValueError(
                f"{path} lacks optimizer state the model's optimizer has: {fmt_list(missing)} (another optimizer "
                "type, or parameters that were frozen when it was saved?)"
            )
    dcp.load({prefix: state}, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner())
    dsd.set_optimizer_state_dict(model, optimizer, state)


def _load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    with all_ranks_or_none(model, "load_fsdp1_checkpoint"):
        state = torch_load_safely(path)
        if not (isinstance(state, dict) and isinstance(state.get("state"), dict) and "param_groups" in state):
            raise ValueError(f"{path} is not an optimizer state dict (no 'state' and 'param_groups')")
        if any(not isinstance(k, str) for k in state["state"]):
            raise ValueError(
                f"{path} is keyed by parameter index, as optimizer.state_dict() of an FSDP1 model is: those are "
                "flat per-rank shards. Save it with FSDP.optim_state_dict(model, optimizer) (what Accelerate does) "
                "under FSDP1 at the original world size, then load that"
            )
        # FSDP1's full optim_state_dict with use_orig_params=True writes Adam state whose first moment equals its
        # second everywhere, which training never produces (docs/migrating.md)
        pairs = [
            (e["exp_avg"], e["exp_avg_sq"])
            for e in state["state"].values()
            if isinstance(e, dict) and isinstance(e.get("exp_avg"), torch.Tensor) and "exp_avg_sq" in e
        ]
        if pairs and all(torch.equal(a, b) and bool((a < 0).sum() == 0) for a, b in pairs):
            raise ValueError(
                f"{path}: every exp_avg equals its exp_avg_sq, which training never produces; FSDP1's full optimizer "
                "state dict with use_orig_params=True writes this (seen with torch 2.13 on CPU). The weights are "
                "fine: load them with optimizer=None, or save the optimizer with SHARDED_STATE_DICT and load that"
            )
        names = {clean_fqn(n) for n, _ in model.named_parameters()}
        unknown = sorted(k for k in state["state"] if k not in names)
        if unknown:
            raise ValueError(f"{path} has optimizer state for parameters the model lacks: {fmt_list(unknown)}")
    dsd.set_optimizer_state_dict(model, optimizer, state, options=dsd.StateDictOptions(full_state_dict=True))


def load_fsdp1_checkpoint(
    model: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> ImportResult:
    """Load a checkpoint written by FSDP1 or Accelerate into a model prepared with `shard_model`.

    Call it on every rank after `shard_model` and after building the optimizer. ``path``: an
    Accelerate ``save_state`` directory (SHARDED_STATE_DICT: ``pytorch_model_fsdp_0/`` and
    ``optimizer_0/``; FULL_STATE_DICT: ``pytorch_model_fsdp.bin`` and ``optimizer.bin``), a DCP
    directory an FSDP1 loop wrote, or a consolidated file `load_full_state_dict` reads. Any world
    size or mesh; nothing is unpickled but tensors. Raises ``ValueError`` naming what differs, on
    every rank, before any tensor is copied. The layouts: docs/migrating.md.
    """
    path = Path(path)
    with all_ranks_or_none(model, "load_fsdp1_checkpoint"):
        kind, model_at, optim_at = _layout(path)
        if optimizer is not None and optim_at is None:
            raise ValueError(f"{path} holds no optimizer state this can read ({OPTIM_DIR}/ or {FULL_OPTIM})")
    if kind == "full":
        result = load_full_state_dict(model, model_at)
    else:
        allocate_for_load(model)  # DCP loads into real storage
        result = ImportResult("dcp", str(model_at), tensors=_load_dcp_model(model, model_at))
    if optimizer is not None:
        (_load_full_optimizer if kind == "full" else _load_dcp_optimizer)(model, optimizer, optim_at)
        result.optimizer_source = str(optim_at)
    return result
