"""Zero-copy (memory-mapped) and copying `load_pretrained`, side by side inside `run_world` ranks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import fsdp2kit as fk


def config(vocab: int):
    """A tiny Llama; an odd vocabulary makes the embedding's split uneven at 2 ranks (FSDP pads rank 1)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip


def save(root: Path, vocab: int, dtype: torch.dtype) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = root / f"llama-v{vocab}-{str(dtype).split('.')[-1]}"
    AutoModelForCausalLM.from_config(config(vocab)).to(dtype).save_pretrained(path)
    return path


def digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def _load(path: Path, mmap: bool):
    from fsdp2kit.models import build_causal_lm

    model = build_causal_lm(str(path), meta=True).float()  # fp32 masters, whatever the file's dtype
    fk.shard_model(model, fk.make_mesh())
    result = fk.load_pretrained(model, path, mmap=mmap)
    return model, result


def _locals(model) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _train(model, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    vocab = model.config.vocab_size
    losses = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, 17), generator=g)
        loss = F.cross_entropy(model(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _file_backed(model, path: Path) -> int:
    """How many local shards live in a storage the size of the checkpoint file (i.e. its mapping)."""
    size = (path / "model.safetensors").stat().st_size
    return sum(
        1
        for p in model.parameters()
        if isinstance(p, DTensor) and p.to_local().numel() and p.to_local().untyped_storage().nbytes() == size
    )


def compare(paths: list[str], steps: int) -> list[dict]:
    """Per checkpoint: both loads' shards, a few AdamW steps' losses and final shards, compared bitwise."""
    out = []
    for p in map(Path, paths):
        before = digest(p)
        mapped, r_map = _load(p, mmap=True)
        copied, r_copy = _load(p, mmap=False)
        a, b = _locals(mapped), _locals(copied)
        case = {
            "path": p.name,
            "bytes_mapped": r_map.bytes_mapped,
            "bytes_read": r_map.bytes_read,
            "copy_bytes_mapped": r_copy.bytes_mapped,
            "file_backed": _file_backed(mapped, p),
            "copy_file_backed": _file_backed(copied, p),
            "params": sum(1 for _ in mapped.parameters()),
            "load_differs": sorted(n for n in a if not torch.equal(a[n], b[n])),
        }
        case["losses_mapped"], case["losses_copied"] = _train(mapped, steps), _train(copied, steps)
        a, b = _locals(mapped), _locals(copied)
        case["trained_differs"] = sorted(n for n in a if not torch.equal(a[n], b[n]))
        case["file_unchanged"] = digest(p) == before
        out.append(case)
    return out
