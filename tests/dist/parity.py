"""Sharded training against a single-process reference, run inside `run_world` ranks.

The reference is the same model, unsharded, trained in one process on the concatenation of
every rank's batch. With a mean loss and equal per-rank batches, FSDP's averaged gradients are
exactly the reference's gradients, so parameters must agree step by step up to float rounding.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from comm_check import counted_calls, predicted_calls
from models import build, lm_loss

import fsdp2kit as fk

VOCAB, SEQ, BATCH = 96, 12, 2


@dataclass(frozen=True)
class Case:
    model: str = "llama"
    strategy: str | None = None
    optim: str = "adamw"
    shard: int = -1
    replicate: int = 1
    accum: int = 1
    clip: float | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool | int | None = None
    mixed_precision: str | None = None
    steps: int = 3
    # Wrappers (fsdp2kit's speed and memory knobs), applied in the documented order.
    float8: bool | None = None  # enable_float8(fsdp_all_gather=...) when not None
    ac: str | int | None = None  # apply_activation_checkpointing(mode=...)
    compile: bool = False  # compile_blocks
    prefetch: tuple[int, int] | None = None  # set_prefetch(forward, backward)
    keep_params: bool = False  # return the final full parameters, to compare cases with each other
    accumulation: str | None = None  # fk.accumulate's policy for the accum micro-steps (None: fk.no_sync)
    count: bool = False  # count the first step's collectives, against fsdp2kit.planner.comm's prediction

    @property
    def label(self) -> str:
        parts = [self.model, self.strategy or "default", self.optim]
        if self.replicate != 1:
            parts.append(f"mesh {self.replicate}x{dist.get_world_size() // self.replicate}")
        if self.accum > 1:
            parts.append(f"{self.accumulation or 'no_sync'} x{self.accum}")
        elif self.accumulation:
            parts.append(self.accumulation)
        if self.count:
            parts.append("bytes counted")
        if self.clip:
            parts.append(f"clip {self.clip}")
        if self.cpu_offload:
            parts.append("cpu_offload")
        if self.reshard_after_forward is not None:
            parts.append(f"reshard_after_forward={self.reshard_after_forward}")
        if self.mixed_precision:
            parts.append(self.mixed_precision)
        if self.float8 is not None:
            parts.append("float8" + (" all-gather" if self.float8 else ""))
        if self.ac is not None:
            parts.append(f"AC {self.ac}")
        if self.compile:
            parts.append("compiled")
        if self.prefetch is not None:
            parts.append(f"prefetch {self.prefetch[0]}/{self.prefetch[1]}")
        return ", ".join(parts)


_meshes: dict[tuple[int, int], object] = {}


def _mesh(shard: int, replicate: int):
    if (shard, replicate) not in _meshes:
        _meshes[(shard, replicate)] = fk.make_mesh(shard=shard, replicate=replicate)
    return _meshes[(shard, replicate)]


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    # eps well above the gradients' rounding noise: Adam divides by sqrt(v), so a gradient that is
    # zero up to rounding would otherwise take a full-size step of random sign in both runs.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


def run_case(case: Case) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build(case.model)
    model = copy.deepcopy(ref)
    if case.float8 is not None:
        fk.enable_float8(model, fsdp_all_gather=case.float8)
    if case.ac is not None:
        fk.apply_activation_checkpointing(model, case.ac)
    if case.compile:
        if hasattr(model, "config"):
            model.config.use_cache = False  # no KV cache in training: see compile_blocks
        fk.compile_blocks(model)
    mesh = _mesh(case.shard, case.replicate)
    policy = case.accumulation or ("no_sync" if case.accum > 1 else "regather")
    predicted = None
    if case.count:  # from the unsharded model, as a user plans before launching
        predicted = fk.plan_comm(
            model,
            shard=mesh.shape[-1],
            replicate=mesh.shape[0] if mesh.ndim == 2 else 1,
            strategy=case.strategy,
            reshard_after_forward=case.reshard_after_forward,
            mixed_precision=case.mixed_precision,
            micro_batches=case.accum,
            accumulation=policy,
        )
    plan = fk.shard_model(
        model,
        mesh,
        strategy=case.strategy,
        cpu_offload=case.cpu_offload,
        reshard_after_forward=case.reshard_after_forward,
        mixed_precision=case.mixed_precision,
    )
    if case.prefetch is not None:
        fk.set_prefetch(model, *case.prefetch)
    opt, ref_opt = _optimizer(case.optim, model.parameters()), _optimizer(case.optim, ref.parameters())
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    counted, modes_left = None, 0
    for step in range(case.steps):
        step_loss, ref_step_loss = torch.zeros(()), torch.zeros(())
        counting = fk.count_collectives(mesh) if predicted is not None and step == 0 else contextlib.nullcontext()
        with counting as counts:
            for micro in range(case.accum):
                tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=gen)
                local = tokens[rank * BATCH : (rank + 1) * BATCH]
                if case.accumulation is None:  # fk.no_sync, as users of earlier versions accumulate
                    sync = micro == case.accum - 1
                    accumulating = contextlib.nullcontext() if sync else fk.no_sync(model)
                else:
                    accumulating = fk.accumulate(model, case.accumulation, micro, case.accum)
                with accumulating:
                    loss = lm_loss(model, local) / case.accum
                    loss.backward()
                step_loss += loss.detach()
                ref_loss = lm_loss(ref, tokens) / case.accum
                ref_loss.backward()
                ref_step_loss += ref_loss.detach()
        if counts is not None:
            counted = counted_calls(counts)
            modes_left = torch._C._len_torch_dispatch_stack()  # the counting mode is gone with its block
        if case.clip:
            norms.append(fk.clip_grad_norm_(model.parameters(), case.clip).item())
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip).item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        ref_losses.append(ref_step_loss.item())

    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, ""
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor().detach().cpu().float()
        if case.keep_params:
            params[name] = full
        r = ref_params[name].detach()
        rel = ((full - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        if rel > worst:
            worst, worst_name = rel, name
    # The plan's per-rank figure is analytic; rank 0 holds the largest shard, so it must match exactly.
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    tied_ok = True
    if "tied" in case.model:
        head = model.lm_head if hasattr(model, "lm_head") else model.head
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.tok
        tied_ok = head.weight is emb.weight
    return {
        "label": case.label,
        "world": world,
        "worst_rel": worst,
        "worst_param": worst_name,
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "tied_ok": tied_ok,
        "n_units": len(plan.units),
        "plan_bytes": plan.param_bytes_per_rank,
        "local_bytes": local_bytes,
        "params": params,
        "counted": counted,
        "predicted": predicted_calls(predicted) if predicted is not None else None,
        "predicted_units": len(predicted.units) if predicted is not None else 0,
        "modes_left": modes_left,
    }


def run_cases(cases: list[Case]) -> list[dict]:
    return [run_case(c) for c in cases]
