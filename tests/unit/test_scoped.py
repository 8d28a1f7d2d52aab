"""Scoped patching (fsdp2kit._internal.scoped): seen by the library's own call on its own thread only.

The guarantees: another thread sees torch's own functions meanwhile, diverts nest, and nothing
outlives the block. materialize's replay is a TorchFunctionMode that every torch.nn.init function
reaches: those that do not dispatch themselves (trunc_normal_, eye_, orthogonal_...) are diverted
for its call, on its thread only."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import fsdp2kit as fk
from fsdp2kit._internal.scoped import divert
from fsdp2kit.models import build_causal_lm

pytestmark = pytest.mark.timeout(120)


def _skip_meta(original, tensor, *args, **kwargs):
    return tensor if tensor.is_meta else original(tensor, *args, **kwargs)


def test_other_threads_see_torch_and_everything_is_undone():
    import transformers.initialization as hf_init

    register, normal, hf_normal = nn.Module.register_parameter, torch.nn.init.normal_, hf_init.TORCH_INIT_FUNCTIONS
    hf_before = dict(hf_normal)
    seen = []
    other = threading.Thread(target=lambda: seen.append(torch.nn.init.normal_(torch.zeros(64)).std().item()))
    with divert(torch.nn.init, "normal_", _skip_meta):
        assert torch.nn.init.normal_ is not normal  # the stand-in: this thread's calls skip meta tensors
        weight = torch.zeros(3, device="meta")
        assert torch.nn.init.normal_(weight) is weight
        other.start()
        other.join()
        assert torch.nn.init.normal_(torch.zeros(64)).std() > 0.5  # a real tensor: initialised
    assert seen and seen[0] > 0.5  # the other thread ran torch's own function
    assert nn.Module.register_parameter is register and torch.nn.init.normal_ is normal
    assert hf_before == hf_init.TORCH_INIT_FUNCTIONS
    assert not [n for n, p in build_causal_lm("demo", meta=True).named_parameters() if vars(p)]


def test_divert_nests_and_is_per_thread():
    class Owner:
        @staticmethod
        def f(x):
            return x

    class Other:
        f = Owner.f

    original = Owner.f
    with divert(Owner, "f", lambda orig, x: orig(x) + 1), divert(Other, "f", lambda orig, x: orig(x) * 10):
        with divert(Owner, "f", lambda orig, x: orig(x) * 2):
            assert Owner.f(1) == 4  # inner over outer over the original
            results = []
            thread = threading.Thread(target=lambda: results.append((Owner.f(1), Other.f(1))))
            thread.start()
            thread.join()
            assert results == [(1, 1)]
        assert Owner.f(1) == 2 and Other.f(1) == 10
        held = Owner.f  # kept past the block (as `from m import f` would)
    assert Owner.f is original and Other.f is original
    assert held(1) == 1


class EyesChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4, bias=False)

    def reset_parameters(self):
        seen = []  # another thread meanwhile: torch's own eye_ on a plain tensor, not the replay
        other = threading.Thread(target=lambda: seen.append(torch.nn.init.eye_(torch.zeros(4, 4))))
        other.start()
        other.join()
        assert torch.equal(seen[0], torch.eye(4))
        torch.nn.init.eye_(self.child.weight)


def test_materialize_diverts_undispatched_init_functions_for_its_call_only(mesh):
    before = dict(vars(torch.nn.init))
    with torch.device("meta"):
        model = EyesChild()
    fk.shard_model(model, mesh, blocks=[nn.Linear])
    fk.materialize(model, init_fn=lambda m: m.reset_parameters() if m is model else None)
    assert torch.equal(model.child.weight.full_tensor(), torch.eye(4))
    assert dict(vars(torch.nn.init)) == before


def test_meta_build_then_init_equals_transformers_own_init(mesh):
    """A meta build initialises as transformers' own meta build does: by its init, or by materialize."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the reference: no fsdp2kit in its construction
        reference = AutoModelForCausalLM.from_config(build_causal_lm("demo", meta=True).config)
    reference.to_empty(device="cpu")
    torch.manual_seed(5)
    reference.initialize_weights()  # what transformers runs on a meta-built model's missing weights
    # transformers' own init after to_empty, as on a model it built on meta itself.
    ours = build_causal_lm("demo", meta=True)
    ours.to_empty(device="cpu")
    torch.manual_seed(5)
    ours.initialize_weights()
    for (name, p), (_, q) in zip(ours.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    buffers = dict(build_causal_lm("demo", meta=False).named_buffers())
    unsharded = build_causal_lm("demo", meta=True)  # materialize keeps these very Parameter objects
    sharded = build_causal_lm("demo", meta=True)
    fk.shard_model(sharded, mesh)
    for model in (unsharded, sharded):
        torch.manual_seed(5)
        fk.materialize(model, device="cpu")
        ours = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
        for name, p in reference.named_parameters():
            assert torch.equal(ours[name], p), name
        for name, b in model.named_buffers():  # rotary inv_freq: computed by construction, not skipped
            assert torch.equal(b, buffers[name]), name


def test_quiet_imports_drops_torchao_lines_of_this_thread_only(caplog):
    import logging

    from fsdp2kit._internal.quiet import quiet_imports

    logger = logging.getLogger("torchao")
    before = list(logger.filters)
    with caplog.at_level(logging.WARNING, logger="torchao"), quiet_imports():
        logger.warning("Failed to load /x/_C_mxfp8.so: no CUDA")
        logger.warning("something else")
        other = threading.Thread(target=lambda: logger.warning("Failed to load /y.so (another thread)"))
        other.start()
        other.join()
    assert [r.getMessage() for r in caplog.records] == ["something else", "Failed to load /y.so (another thread)"]
    assert logger.filters == before


def test_importing_fsdp2kit_changes_nothing_process_wide():
    """No logging filter, warning filter or patch is installed by ``import fsdp2kit`` (it used to filter
    torchao's and torch's loggers there, for the whole process). The libraries it imports are imported
    first (what their own imports change is theirs), then fsdp2kit alone, between two snapshots."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{tests.parent}:{tests}"}
    imports = "import fsdp2kit, fsdp2kit.models, fsdp2kit.planner\n"
    listing = imports + "import sys; print(' '.join(m for m in sys.modules if not m.startswith('fsdp2kit')))\n"
    code = (
        "import importlib, side_effects, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n        importlib.import_module(name)\n    except Exception:\n        pass\n"
        "before = side_effects.snapshot()\n"
        + imports
        + "print(side_effects.differences(before, side_effects.snapshot()))\n"
    )
    deps = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, env=env, timeout=120)
    assert deps.returncode == 0, deps.stderr
    run = [sys.executable, "-c", code, *deps.stdout.split()]
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
