"""Tiny models shared by the tests: a hand-written transformer and Hugging Face configs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    """A plain PyTorch decoder: no _no_split_modules, so block detection must use structure."""

    def __init__(
        self, vocab: int = 96, dim: int = 40, depth: int = 3, heads: int = 4, seq: int = 16, tied: bool = False
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.trunk = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.trunk:
            x = block(x)
        return self.head(self.norm(x))


def tiny_llama(tied: bool = False, layers: int = 3, hidden: int = 40, intermediate: int = 56):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "tinygpt":
        return TinyGPT()
    if kind == "tinygpt-tied":
        return TinyGPT(tied=True)
    if kind == "llama":
        return tiny_llama()
    if kind == "llama-tied":
        return tiny_llama(tied=True)
    # float8 matmuls need both dimensions of a Linear divisible by 16
    if kind == "llama-f8":
        return tiny_llama(hidden=32, intermediate=64)
    if kind == "tinygpt-f8":
        return TinyGPT(dim=32)
    raise ValueError(kind)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over tokens, for both our models and Hugging Face ones."""
    out = model(tokens[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def worst_relative(model: nn.Module, ref: nn.Module) -> tuple[float, str]:
    """The largest ``max|sharded - ref| / max|ref|`` over ``model``'s DTensor parameters, and its name."""
    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        r = ref_params[name].detach()
        rel = ((p.full_tensor().detach() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        if rel > worst:
            worst, worst_name = rel, name
    return worst, worst_name
