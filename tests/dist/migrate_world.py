"""Rank bodies for test_migrate_checkpoints.py: FSDP1 writes checkpoints at one world size, FSDP2 loads them at others.

The saves use FSDP1's own state-dict APIs in the layout Accelerate's ``save_state`` writes
(accelerate/utils/fsdp_utils.py: ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` through DCP with
``model`` / ``optimizer`` top-level keys, or ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` from
``torch.save``), and, when accelerate is installed, with Accelerate's own functions as well. The
reference is FSDP1's full state (model and per-name optimizer state) gathered at save time; the
loaded FSDP2 model's full state must equal it bit for bit.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from models import TinyGPT

import fsdp2kit as fk

VOCAB, SEQ = 96, 16


class Scale(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.n = n
        self.register_buffer("value", torch.full((n,), 2.0), persistent=False)


class BufferedGPT(TinyGPT):
    """TinyGPT with a non-persistent buffer, which DeepSpeed's consolidated files include anyway."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.scale = Scale(4)


VARIANTS = {
    # name: (model kwargs, use_orig_params, two param groups)
    "flat": ({}, False, False),
    "orig_tied_groups": ({"tied": True}, True, True),
}


def _model(variant: str, seed: int) -> nn.Module:
    kwargs, _, _ = VARIANTS[variant]
    torch.manual_seed(seed)
    return BufferedGPT(vocab=VOCAB, seq=SEQ, **kwargs)


def _optimizer(variant: str, model: nn.Module, names_of, lr: float = 1e-2) -> torch.optim.Optimizer:
    _, _, groups = VARIANTS[variant]
    params = list(model.named_parameters())
    if not groups:
        return torch.optim.AdamW([p for _, p in params], lr=lr, weight_decay=0.1)
    # By name, not by p.dim(): FSDP1's use_orig_params parameters are 1-D views of the flat shard.
    decay = [p for n, p in params if names_of(n).endswith("weight") and "norm" not in n]
    rest = [p for n, p in params if not (names_of(n).endswith("weight") and "norm" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def save_fsdp1(root: str) -> list[str]:
    """World 2: FSDP1 trains two steps per variant and writes every layout we load."""
    import torch.distributed.checkpoint as dcp
    from fsdp1 import wrap_fsdp1
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank = dist.get_rank()
    mesh = fk.make_mesh()
    written = []
    for variant, (_, orig, _) in VARIANTS.items():
        out = Path(root) / variant
        model = wrap_fsdp1(_model(variant, seed=0), mesh, use_orig_params=orig)
        opt = _optimizer(variant, model, lambda n: n.replace("_fsdp_wrapped_module.", ""))
        _train(model, opt)

        # Accelerate's SHARDED_STATE_DICT layout, through FSDP1's API (fsdp_utils.save_fsdp_model/_optimizer)
        with FSDP.state_dict_type(
            model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
        ):
            dcp.save({"model": model.state_dict()}, checkpoint_id=out / "sharded" / "pytorch_model_fsdp_0")
            dcp.save({"optimizer": FSDP.optim_state_dict(model, opt)}, checkpoint_id=out / "sharded" / "optimizer_0")
        # FULL_STATE_DICT: rank 0 writes torch.save files
        full_cfg = FullStateDictConfig(rank0_only=True)  # offload_to_cpu must stay off on a CPU device
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg, FullOptimStateDictConfig()):
            sd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        # The reference: the full state gathered from FSDP1's sharded (DTensor) state dicts. Not FSDP1's
        # FULL optim_state_dict: with use_orig_params=True it gives exp_avg == exp_avg_sq (torch 2.13, CPU).
        with FSDP.state_dict_type(
            model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
        ):
            ref = {"model": _full(model.state_dict()), "optim": FSDP.optim_state_dict(model, opt)}
            ref["optim"]["state"] = {k: _full(v) for k, v in ref["optim"]["state"].items()}
        if rank == 0:
            (out / "full").mkdir(parents=True, exist_ok=True)
            torch.save(sd, out / "full" / "pytorch_model_fsdp.bin")
            torch.save(osd, out / "full" / "optimizer.bin")
            torch.save(ref, out / "reference.pt")
            _write_deepspeed_like(out / "zero_to_fp32", ref["model"])
        if _has_accelerate():
            _save_with_accelerate(model, opt, out / "accelerate")
        dist.barrier()
        written.append(variant)
    return written


def _full(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}


def _write_deepspeed_like(out: Path, state: dict) -> None:
    """What ``zero_to_fp32.py CKPT OUT --safe_serialization --max_shard_size`` writes: safetensors shards
    with an index, parameters and buffers (non-persistent ones included) under module names."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    if "head.weight" in state and torch.equal(state["head.weight"], state["tok.weight"]):
        del state["head.weight"]  # tied: safetensors stores shared tensors once
    state["scale.value"] = torch.full((4,), 2.0)
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(out / name))
        weight_map.update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _has_accelerate() -> bool:
    try:
        import accelerate.utils.fsdp_utils  # noqa: F401
    except ImportError:
        return False
    return True


def _save_with_accelerate(model, opt, out: Path) -> None:
    """Accelerate's own save_fsdp_model / save_fsdp_optimizer (SHARDED_STATE_DICT, use_dcp=True)."""
    from accelerate import PartialState
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    PartialState(cpu=True)  # accelerate's logging needs its state object
    plugin = types.SimpleNamespace(
        fsdp_version=1,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
        state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
        optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True),
    )
    accelerator = types.SimpleNamespace(process_index=dist.get_rank(), num_processes=dist.get_world_size())
    save_fsdp_model(plugin, accelerator, model, str(out))
    save_fsdp_optimizer(plugin, accelerator, opt, model, str(out))


def _diff(ref: dict, got: dict, what: str) -> list[str]:
    bad = [f"{what}: {k} missing" for k in ref if k not in got]
    bad += [f"{what}: {k} differs" for k in ref if k in got and not torch.equal(ref[k], got[k])]
    return bad


def _group_key(group: dict) -> tuple:
    return sorted(group["params"]), group.get("weight_decay"), group.get("lr"), sorted(group)


def load_and_compare(root: str) -> dict[str, list[str]]:
    """Any world size: FSDP2 loads every layout; the full state must equal FSDP1's bit for bit."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    results: dict[str, list[str]] = {}
    for variant in VARIANTS:
        ref = torch.load(Path(root) / variant / "reference.pt", weights_only=True)
        layouts = ["sharded", "full", "sharded-meta", "zero_to_fp32"]
        if (Path(root) / variant / "accelerate").is_dir():
            layouts.append("accelerate")
        for layout in layouts:
            meta = layout.endswith("-meta")
            if meta:
                with torch.device("meta"):
                    model = _model(variant, seed=7)
            else:
                model = _model(variant, seed=7)
            fk.shard_model(model, fk.make_mesh())
            path = Path(root) / variant / layout.removesuffix("-meta")
            if meta:  # weights straight into a meta-built model, then the optimizer built and loaded
                fk.load_fsdp1_checkpoint(model, path)
            opt = _optimizer(variant, model, lambda n: n, lr=5e-3)  # the load must restore the saved lr, 1e-2
            # FSDP1's full optimizer file is wrong under use_orig_params (see save_fsdp1): it must be refused
            bad_file = layout == "full" and VARIANTS[variant][1]
            with_optim = layout != "zero_to_fp32" and not bad_file
            if layout == "zero_to_fp32":
                res = fk.load_full_state_dict(model, Path(root) / variant / layout)
            elif bad_file:
                try:
                    fk.load_fsdp1_checkpoint(model, path, opt)
                    results[f"{variant}/{layout}/refused"] = ["the bad optimizer file was loaded"]
                except ValueError as e:
                    ok = "exp_avg equals its exp_avg_sq" in str(e)
                    results[f"{variant}/{layout}/refused"] = [] if ok else [f"unexpected error: {e}"]
                res = fk.load_fsdp1_checkpoint(model, path)  # the weights alone
            else:
                res = fk.load_fsdp1_checkpoint(model, path, opt)
            bad = _diff(ref["model"], get_model_state_dict(model, options=full), "weights")
            if with_optim:
                got = get_optimizer_state_dict(model, opt, options=full)
                for fqn, entries in ref["optim"]["state"].items():
                    bad += _diff(
                        {f"{fqn}.{k}": torch.as_tensor(v) for k, v in entries.items()},
                        {f"{fqn}.{k}": torch.as_tensor(v) for k, v in got["state"].get(fqn, {}).items()},
                        "optimizer",
                    )
                want_groups = sorted(_group_key(g) for g in ref["optim"]["param_groups"])
                got_groups = sorted(_group_key(g) for g in got["param_groups"])
                if want_groups != got_groups:
                    bad.append(f"param_groups differ: {want_groups} vs {got_groups}")
                if not ref["optim"]["state"]:
                    bad.append("reference has no optimizer state")
            if layout == "zero_to_fp32" and res.skipped_keys != ["scale.value"]:
                bad.append(f"skipped_keys {res.skipped_keys}, expected ['scale.value']")
            if res.tensors == 0:
                bad.append("no tensor loaded")
            results[f"{variant}/{layout}"] = bad
    return results


def expect_errors(root: str) -> dict[str, str]:
    """Bad inputs raise the same clear error on every rank, before anything is loaded."""
    out = {}
    model = _model("flat", seed=3)
    fk.shard_model(model, fk.make_mesh())
    opt = _optimizer("flat", model, lambda n: n)
    for label, fn in {
        "optimizer dir instead of its parent": lambda: fk.load_fsdp1_checkpoint(
            model, Path(root) / "flat" / "sharded" / "optimizer_0"
        ),
        "weights-only dir with optimizer": lambda: fk.load_fsdp1_checkpoint(
            model, Path(root) / "flat" / "zero_to_fp32", opt
        ),
    }.items():
        try:
            fn()
            out[label] = "no error"
        except ValueError as e:
            out[label] = str(e)
    return out


def load_world(root: str) -> dict:
    """One spawn per world size: every layout compared, then the bad inputs."""
    return {"compare": load_and_compare(root), "errors": expect_errors(root)}


if __name__ == "__main__":  # pragma: no cover - a manual run: python tests/dist/migrate_world.py DIR
    import sys

    from fsdp2kit.testing import run_world

    os.makedirs(sys.argv[1], exist_ok=True)
    print(run_world(save_fsdp1, 2, sys.argv[1]))
    print(run_world(load_and_compare, 3, sys.argv[1])[0])
