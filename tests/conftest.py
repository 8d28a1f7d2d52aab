"""Test-wide set-up: the shared tiny models and the recipe/benchmark support on sys.path, and the parity table."""

import os
import sys

# Tests import the shared tiny models as `models`; spawned ranks inherit this sys.path.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
# The recipe's and the benchmarks' own support modules, imported as their scripts import them.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import pytest
import torch

# torch fills the table of functions a torch.device(...) context redirects on the first call under one;
# if that first call happens inside transformers' from_pretrained (which tests and recipes/generate.py
# call), the table keeps transformers' temporary torch.linspace wrapper and, for the rest of the session,
# torch.linspace under torch.device("meta") makes CPU tensors: a test's meta-built module then gets real
# buffers or not depending on which tests ran before it. Filling the table here makes that order-free.
with torch.device("meta"):
    torch.empty(0)

_PARITY: list[tuple[str, int, float, str]] = []


@pytest.fixture(scope="session")
def parity_table() -> list:
    return _PARITY


@pytest.fixture(scope="module")
def selected(request):
    """``selected(*names)``: the values of those parameters over this module's tests that the session runs, so a
    spawned world trains only the cases some selected test reads (under -m "not slow", not the slow ones)."""

    def values(*names: str) -> set:
        items = [i for i in request.session.items if i.module is request.module and hasattr(i, "callspec")]
        return {tuple(i.callspec.params[n] for n in names) for i in items if set(names) <= set(i.callspec.params)}

    return values


def pytest_terminal_summary(terminalreporter):
    if not _PARITY:
        return
    terminalreporter.section("parity with single-process training (worst relative parameter difference)")
    width = max(len(r[0]) for r in _PARITY)
    for label, world, rel, name in sorted(_PARITY, key=lambda r: (r[1], r[0])):
        terminalreporter.write_line(f"{label.ljust(width)}  world {world}  {rel:.1e}  ({name})")


def pytest_collection_modifyitems(config, items):
    """Skip the `cuda` tests, cleanly and with the reason, where there is no CUDA GPU."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); `make gpu-check` runs these")
    for item in cuda_items:
        item.add_marker(skip)
