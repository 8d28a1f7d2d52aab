"""FSDP1 through `wrap_fsdp1` against the single-process reference, inside `run_world` ranks.

The same method as parity.py: the reference trains one unsharded copy on the concatenation of
every rank's batch; with a mean loss and equal per-rank batches, FSDP1's averaged gradients are
the reference's gradients, so the parameters must agree after every step up to float rounding.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fsdp1 import wrap_fsdp1
from models import build, lm_loss
from parity import BATCH, SEQ, VOCAB, _optimizer
from torch.distributed.fsdp import FullyShardedDataParallel

import fsdp2kit as fk


@dataclass(frozen=True)
class Fsdp1Case:
    model: str = "llama"
    strategy: str | None = None
    optim: str = "adamw"
    forward_prefetch: bool = False
    use_orig_params: bool = False
    steps: int = 3

    @property
    def label(self) -> str:
        parts = ["fsdp1", self.model, self.strategy or "default", self.optim]
        if self.forward_prefetch:
            parts.append("forward_prefetch")
        if self.use_orig_params:
            parts.append("use_orig_params")
        return ", ".join(parts)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def run_case(case: Fsdp1Case, mesh) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build(case.model)
    model = wrap_fsdp1(
        copy.deepcopy(ref),
        mesh,
        strategy=case.strategy,
        forward_prefetch=case.forward_prefetch,
        use_orig_params=case.use_orig_params,
    )
    opt, ref_opt = _optimizer(case.optim, model.parameters()), _optimizer(case.optim, ref.parameters())
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses = [], []
    for _ in range(case.steps):
        tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=gen)
        loss = lm_loss(model, tokens[rank * BATCH : (rank + 1) * BATCH])
        loss.backward()
        ref_loss = lm_loss(ref, tokens)
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item() / world)
        ref_losses.append(ref_loss.item())

    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, ""
    with FullyShardedDataParallel.summon_full_params(model):
        names = [_clean(n) for n, _ in model.named_parameters()]
        for name, p in zip(names, model.parameters()):
            r = ref_params[name].detach()
            rel = ((p.detach() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
            if rel > worst:
                worst, worst_name = rel, name
    n_units = sum(1 for m in model.modules() if isinstance(m, FullyShardedDataParallel))
    return {
        "label": case.label,
        "worst_rel": worst,
        "worst_param": worst_name,
        "losses": losses,
        "ref_losses": ref_losses,
        "n_params": len(names),
        "n_ref_params": len(ref_params),
        "n_units": n_units,
    }


def run_cases(cases: list[Fsdp1Case]) -> list[dict]:
    mesh = fk.make_mesh()
    return [run_case(c, mesh) for c in cases]
