"""The variants fsdp1_vs_fsdp2.py compares (DDP, FSDP1, FSDP2 through fsdp2kit), built and stepped alike."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from fsdp1 import wrap_fsdp1
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

import fsdp2kit as fk

__all__ = ["GRID", "REVERTIBLE", "Config", "Variant", "build_variant", "make_batches", "revert_defaults", "train_step"]


@dataclass(frozen=True)
class Config:
    """One way to run a library. The axes of `GRID` exist in both FSDP1 and FSDP2; knobs that
    exist in only one keep that library's default (FSDP1: backward_prefetch=BACKWARD_PRE,
    limit_all_gathers=True; FSDP2: fsdp2kit's reshard defaults, one block of backward prefetch)."""

    strategy: str = "FULL_SHARD"  # or SHARD_GRAD_OP (ZeRO-2: no re-gather in backward)
    forward_prefetch: bool = False  # FSDP1 forward_prefetch=True / fk.set_prefetch(forward=1)
    compile: bool = False  # every block compiled with fk.compile_blocks (FSDP1: use_orig_params=True)
    # FSDP2 only: shard_model defaults to undo after it, to measure each (see `revert_defaults`)
    revert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "revert", tuple(self.revert))  # a JSON list read back stays hashable

    def describe(self) -> str:
        parts = [self.strategy]
        if self.forward_prefetch:
            parts.append("fwd prefetch")
        if self.compile:
            parts.append("compiled")
        if self.revert:
            parts.append("without " + " + ".join(self.revert))
        return ", ".join(parts)


GRID = [Config(s, p, c) for s in ("FULL_SHARD", "SHARD_GRAD_OP") for p in (False, True) for c in (False, True)]


@dataclass(frozen=True)
class Variant:
    key: str  # the JSON key: ddp, fsdp1, fsdp2, fsdp1_best, fsdp2_best, or a search candidate
    impl: str  # "ddp" | "fsdp1" | "fsdp2"
    config: Config = Config()

    @property
    def label(self) -> str:
        name = {"ddp": "DDP", "fsdp1": "FSDP1", "fsdp2": "FSDP2 (fsdp2kit)"}[self.impl]
        if self.impl == "ddp":
            return name
        if self.key.endswith("_best"):
            return f"{name} best [{self.config.describe()}]"
        return f"{name} defaults" if self.config == Config() else f"{name} [{self.config.describe()}]"


# ---------------------------------------------------------------------------------------------
# Building and stepping a variant


def build_variant(
    v: Variant, model: nn.Module, mesh, info: fk.DistInfo, args
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap ``model`` (a fresh copy of the base model, on the device) as ``v`` says; optimizer last."""
    c = v.config
    blocks = fk.find_blocks(model)
    if args.ac and v.impl == "fsdp2":
        fk.apply_activation_checkpointing(model, mode="full")  # before compile and shard_model
    if c.compile:
        fk.compile_blocks(model)
    if v.impl == "ddp":
        if args.ac:
            _checkpoint_wrap(model, blocks)
        model = DistributedDataParallel(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    elif v.impl == "fsdp1":
        model = wrap_fsdp1(
            model,
            mesh,
            strategy=c.strategy,
            mixed_precision=args.mixed_precision,
            forward_prefetch=c.forward_prefetch,
            use_orig_params=c.compile,
        )
        if args.ac:
            # after wrapping, as FSDP1's docs do it: the checkpoint goes inside each FSDP unit, so
            # the recompute does not run the unit's all-gather hooks a second time
            _checkpoint_wrap(model, blocks)
    else:
        fk.shard_model(model, mesh, strategy=c.strategy, mixed_precision=args.mixed_precision)
        revert_defaults(model, c.revert)
        if c.forward_prefetch:
            fk.set_prefetch(model, forward=1, backward=1)
    # foreach=None is torch's default: the multi-tensor path on CUDA, a per-parameter loop on CPU
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True if args.foreach else None)


# shard_model's step defaults (issue 15) that a variant can undo, each back to what it did before.
REVERTIBLE = ("embedding_unshard",)


def revert_defaults(model: nn.Module, revert: tuple[str, ...]) -> None:
    """Undo some of `shard_model`'s step defaults: the embedding units' skipped all-gather in
    backward (back to FSDP2's re-gather)."""
    unknown = set(revert) - set(REVERTIBLE)
    if unknown:
        raise ValueError(f"revert: unknown {sorted(unknown)}; choose from {REVERTIBLE}")
    if "embedding_unshard" in revert:
        for unit in model.modules():
            if isinstance(unit, FSDPModule) and isinstance(unit, nn.Embedding):
                unit.set_unshard_in_backward(True)


def _checkpoint_wrap(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Full activation checkpointing of ``blocks`` with torch's non-reentrant checkpoint wrapper
    (FSDP1 and DDP; FSDP2 uses fsdp2kit's, which keeps parameter names)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    ids = {id(b) for b in blocks}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in ids,
    )


def train_step(v: Variant, model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, args) -> torch.Tensor:
    # DDP has no parameter casting: under --mixed-precision it runs the forward in autocast,
    # which is how DDP users get bf16 (FSDP casts the gathered parameters instead).
    autocast = (
        torch.autocast(
            tokens.device.type, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[args.mixed_precision])
        )
        if v.impl == "ddp" and args.mixed_precision not in (None, "fp32")
        else nullcontext()
    )
    with autocast:
        logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def make_batches(n: int, vocab: int, seq: int, batch: int, info: fk.DistInfo, seed: int) -> list[torch.Tensor]:
    """This rank's slice of ``n`` global batches, the same for every variant."""
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        tokens = torch.randint(0, vocab, (info.world_size * batch, seq + 1), generator=g)
        out.append(tokens[info.rank * batch : (info.rank + 1) * batch].to(info.device))
    return out
