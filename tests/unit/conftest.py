"""Unit tests run in a world of one: a gloo group started in the pytest process, for the whole session."""

import pytest

import fsdp2kit as fk


@pytest.fixture(scope="session")
def mesh():
    """A world of one in this very process: enough for every check that runs before a collective."""
    fk.init_distributed(device="cpu")
    return fk.make_mesh()
