"""Restager (an asynchronous save's staging step): after the first save only byte copies, never a stale value.

Every staged state is compared with the one the full path (state-dict functions, as a synchronous
save writes) gives for the same live model and optimizer at that moment.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fsdp2kit.checkpoint.extras import decode
from fsdp2kit.checkpoint.restage import Restager, finish
from fsdp2kit.checkpoint.state import state_to_save

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _train(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(3, 4, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _plain(value):
    """Nested state with the JSON entries decoded, tensors as tensors (comparable with _equal)."""
    if isinstance(value, dict):
        if set(value) <= {"json", "tensors"} and "json" in value:
            return _plain(decode(value))
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _check(stager, model, opt, extra=None) -> dict:
    staged = finish(stager.stage(model, opt, extra, rank=0, rng=False, trainable_only=False))
    expected = state_to_save(model, opt, extra, rank=0, rng=False)
    assert _equal(_plain(staged), _plain(expected))
    return staged


def test_copies_only_after_the_first_save_and_never_goes_stale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    stager = Restager()
    _train(model, opt, 0)
    first = _check(stager, model, opt, extra={"sched": sched, "t": torch.ones(2)})
    assert stager.fast_saves == 0
    buffer = first["model"]["0.weight"]
    assert buffer.data_ptr() != model[0].weight.data_ptr()  # a copy, not the live tensor

    _train(model, opt, 1)
    sched.step()  # a new learning rate: the hyper-parameters are read afresh
    second = _check(stager, model, opt, extra={"sched": sched, "t": torch.full((2,), 3.0)})
    assert stager.fast_saves == 1 and second["model"]["0.weight"] is buffer  # the same buffer, refreshed
    with torch.no_grad():
        model[0].weight.add_(1)
    assert not torch.equal(second["model"]["0.weight"], model[0].weight)  # a snapshot

    # A parameter's memory replaced, the optimizer's state reloaded (new tensors), a parameter
    # frozen: each goes back to the full path, whose result is again exactly the live state.
    with torch.no_grad():
        model[2].bias.data = torch.zeros(2)
    _check(stager, model, opt)
    assert stager.fast_saves == 1
    _check(stager, model, opt)
    assert stager.fast_saves == 2
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors (a plain reload keeps them)
    _train(model, opt, 2)
    _check(stager, model, opt)
    assert stager.fast_saves == 2
    model[2].bias.requires_grad_(False)
    _check(stager, model, opt)
    _check(stager, model, opt)
    assert stager.fast_saves == 3


def test_without_optimizer_and_before_the_first_step():
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stager = Restager()
    for _ in range(2):
        _check(stager, model, None)
    assert stager.fast_saves == 1
    _check(stager, model, opt)  # no optimizer state yet: torch's state dict creates it (zero-gradient step)
    assert stager.fast_saves == 1
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # a real step updates the same state tensors in place
    _check(stager, model, opt)
    _check(stager, model, opt)
    assert stager.fast_saves == 3
