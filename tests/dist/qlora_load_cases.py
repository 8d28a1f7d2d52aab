"""QLoRA built on the meta device and filled by load_pretrained against the eager path, inside `run_world` ranks.

Eager: the checkpoint loaded whole (from_pretrained), quantize_nf4, peft, shard_model. Meta: the
same model built on the meta device, quantize_nf4 (placeholders), peft, shard_model, then
load_pretrained quantizes each rank's rows. Each rank's NF4 shards must be the same bits, and the
logits the same.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from models import tiny_llama

import fsdp2kit as fk
from fsdp2kit.weights.nf4 import NF4_INNER_TENSORS

VOCAB, SEQ = 96, 12
GROUPS = {"block_size": 32, "scaler_block_size": 8}  # whole 256-element groups per rank up to 4 ranks


def _base() -> nn.Module:
    """The checkpoint's model: NF4-friendly sizes, wide init so that a wrong scaler shows in the logits."""
    torch.manual_seed(0)
    model = tiny_llama(hidden=64, intermediate=128)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


def _peft(model: nn.Module) -> nn.Module:
    return fk.apply_lora(model, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])


def _shards(model: nn.Module) -> dict[str, dict]:
    """Every NF4 weight's local shard: inner tensors, metadata."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if type(local).__name__ == "NF4Tensor":
            out[name] = {k: getattr(local, k) for k in NF4_INNER_TENSORS}
            out[name]["meta"] = (tuple(local.shape), local.dtype, local.n_blocks, local.block_size)
    return out


def _logits(model: nn.Module) -> torch.Tensor:
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=x).logits.float()


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def run_meta_qlora(tmp: str, shard: int, replicate: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = fk.make_mesh(shard=shard, replicate=replicate)
    hf_dir = Path(tmp) / f"base-{dist.get_world_size()}"
    if dist.get_rank() == 0:
        _base().to(torch.bfloat16).save_pretrained(hf_dir)  # a bf16 checkpoint, as published models are
    dist.barrier()
    out: dict = {"mismatch": [], "compared": 0, "logits": {}}
    for dtype in (torch.bfloat16, torch.float32):  # quantized from bf16 rows as read, and from rows cast to fp32
        eager = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="eager")
        fk.quantize_nf4(eager, **GROUPS)
        eager = _peft(eager)
        fk.shard_model(eager, mesh)
        with torch.device("meta"):  # built as from_pretrained builds it (rotary buffers stay fp32)
            config = AutoConfig.from_pretrained(hf_dir, attn_implementation="eager")
            meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
        fk.quantize_nf4(meta, **GROUPS)
        meta = _peft(meta)
        fk.shard_model(meta, mesh)
        fk.load_pretrained(meta, hf_dir)
        want, got = _shards(eager), _shards(meta)
        assert want.keys() == got.keys() and want, (sorted(want), sorted(got))
        for name in want:
            for k, v in want[name].items():
                other = got[name][k]
                same = v == other if k == "meta" else (v.dtype == other.dtype and torch.equal(v, other))
                if not same:
                    out["mismatch"].append(f"{dtype} {name} {k}")
            out["compared"] += 1
        out["logits"][str(dtype)] = torch.equal(_logits(eager), _logits(meta))
        out["logits_diff_" + str(dtype)] = (_logits(eager) - _logits(meta)).abs().max().item()
    return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(256, 3, bias=False)  # 3 rows: 768 weights, whole groups, but 3 rows do not split over 2


def run_errors(tmp: str) -> dict:
    mesh = fk.make_mesh(shard=-1)
    out = {}
    with torch.device("meta"):
        model = tiny_llama(hidden=64, intermediate=128)
    fk.quantize_nf4(model, **GROUPS)
    out["materialize"] = _error(lambda: fk.materialize(model))
    with torch.device("meta"):
        odd = nn.Sequential(_Block(), _Block())
    fk.quantize_nf4(odd, blocks=[_Block], **GROUPS)
    out["uneven"] = _error(lambda: fk.shard_model(odd, mesh))
    tp_mesh = fk.make_mesh(shard=1, tp=dist.get_world_size())
    with torch.device("meta"):
        tp_model = tiny_llama(hidden=64, intermediate=128)
    fk.quantize_nf4(tp_model, **GROUPS)
    out["tp"] = _error(lambda: fk.apply_tensor_parallel(tp_model, tp_mesh))
    # A checkpoint without one of the NF4 weights: even with strict=False there is nothing to quantize it from.
    full, partial = Path(tmp) / f"base-{dist.get_world_size()}", Path(tmp) / "partial"
    if dist.get_rank() == 0:
        from safetensors.torch import load_file, save_file

        partial.mkdir()
        (partial / "config.json").write_text((full / "config.json").read_text())
        tensors = load_file(full / "model.safetensors")
        del tensors["model.layers.0.self_attn.q_proj.weight"]
        save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    dist.barrier()
    with torch.device("meta"):
        holed = tiny_llama(hidden=64, intermediate=128)
    fk.quantize_nf4(holed, **GROUPS)
    fk.shard_model(holed, mesh)
    out["missing"] = _error(lambda: fk.load_pretrained(holed, partial, strict=False))
    return out


def run_cases(tmp: str, shard: int, replicate: int, errors: bool) -> dict:
    out = run_meta_qlora(tmp, shard, replicate)
    if errors:
        out["errors"] = run_errors(tmp)
    return out
