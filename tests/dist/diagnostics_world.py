"""Rank-side cases for tests/dist/test_diagnostics.py: non-finite steps, position tracking, desync and hang reports."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import TinyGPT
from torch.distributed.device_mesh import DeviceMesh

import fsdp2kit as fk
from fsdp2kit.diagnostics import DesyncError, NonFiniteError, RankMonitor, check_finite

SEQ, VOCAB = 16, 96


def _model(mesh=None):
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    fk.shard_model(model, mesh if mesh is not None else fk.make_mesh())
    return model


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)


def _loss(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def nonfinite_cases() -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}

    # A healthy step passes on every rank.
    loss = _loss(model, _batch(0))
    loss.backward()
    norm = fk.clip_grad_norm_(model.parameters(), 1.0)
    out["healthy"] = check_finite(model, step=0, loss=loss, grad_norm=norm)
    opt.step()
    opt.zero_grad()

    # NaN enters the gradients at trunk[1]'s output, on rank 1 only; the reduce-scatter spreads it.
    def poison(grad):
        return grad * float("nan")

    def forward_hook(mod, args, output):
        if dist.get_rank() == 1:
            output.register_hook(poison)

    handle = model.trunk[1].register_forward_hook(forward_hook)
    loss = _loss(model, _batch(1))
    loss.backward()
    norm = fk.clip_grad_norm_(model.parameters(), 1.0)
    out["norm_is_nan"] = bool(torch.isnan(norm))
    # the clip left the gradients downstream of the NaN as they were (torch's would make them NaN)
    out["downstream_finite_after_clip"] = bool(torch.isfinite(model.trunk[2].fc1.weight.grad.to_local()).all())
    try:
        check_finite(model, step=7, loss=loss, grad_norm=norm)
        out["raise"] = None
    except NonFiniteError as e:
        out["raise"] = (str(e), e.step, e.module)

    # skip: same verdict everywhere, gradients dropped, parameters unchanged by the skipped step
    before = [p.to_local().clone() for p in model.parameters()]
    ok = check_finite(model, step=7, loss=loss, grad_norm=norm, on_nonfinite="skip")
    out["skip_returned"] = ok
    out["grads_dropped"] = all(p.grad is None for p in model.parameters())
    if ok:
        opt.step()
    out["params_unchanged"] = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
    handle.remove()

    # a non-finite loss on rank 0 alone (the gradients stay finite: the loss is replaced after backward)
    loss = _loss(model, _batch(2))
    loss.backward()
    norm = fk.clip_grad_norm_(model.parameters(), 1.0)
    reported = loss.detach() * (float("inf") if dist.get_rank() == 0 else 1.0)
    try:
        check_finite(model, step=9, loss=reported, grad_norm=norm)
        out["loss_only"] = None
    except NonFiniteError as e:
        out["loss_only"] = (str(e), e.module)
    opt.zero_grad()
    return out


def _train(mon: RankMonitor, model, opt, steps: range, accum: int, skip_at: int = -1, stop_early_at: int = -1):
    for step in steps:
        mon.step(step)
        with mon.guard():
            for i in range(accum):
                if step == skip_at and dist.get_rank() == 1 and i == 0:
                    continue  # a rank that skips a micro-step
                if step == stop_early_at and dist.get_rank() == 1 and i == 1:
                    break  # a rank whose data ran out one micro-step early
                batch = _batch(step, i)
                mon.micro_step(i, batch)
                with fk.no_sync(model) if i < accum - 1 else torch.enable_grad():
                    (_loss(model, batch) / accum).backward()
            mon.step_end()
            mon.phase("optimizer")
            opt.step()
            opt.zero_grad()


def monitor_cases() -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    mon = RankMonitor(model, micro_steps=2, check_every=1, timeout=20, heartbeat=0.2)
    seen = []
    original = mon._set
    mon._set = lambda phase, unit: (seen.append((phase, unit)), original(phase, unit))[1]
    _train(mon, model, opt, range(0, 2), accum=2)
    out["phases"] = seen
    out["position"] = mon.position.describe(2)

    # rank 1 skips micro-step 0 of step 2: caught at the next check, on both ranks, naming rank 1
    start = time.monotonic()
    try:
        _train(mon, model, opt, range(2, 4), accum=2, skip_at=2)
        out["skip"] = None
    except DesyncError as e:
        out["skip"] = (str(e), e.diverged, time.monotonic() - start)
    mon.close()
    return out


def hang_case() -> dict:
    # The model's collectives run on a group with an 8 s timeout (the recipe's [train] timeout
    # plays this part), the monitor's checks time out after 3 s.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=8))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("shard",))
    model = _model(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = RankMonitor(model, micro_steps=2, check_every=2, timeout=3, heartbeat=0.2)
    start = time.monotonic()
    try:
        # rank 1 stops after one micro-step of step 1 (not a checked step) and waits at step 2's
        # first check; rank 0 goes on to micro-step 1 of step 1, whose all-gather nobody answers.
        _train(mon, model, opt, range(0, 3), accum=2, stop_early_at=1)
        out = None
    except DesyncError as e:
        out = (str(e), e.diverged, time.monotonic() - start)
    time.sleep(0.5)  # let the watcher print the other rank's report (it goes to stderr)
    mon.close()
    return {"error": out, "report_seen": mon._reported}
