"""Collectives fsdp2kit gives FSDP2 where the backend's own are slow (gloo on CPU)."""

from fsdp2kit.collectives.gloo import (
    COLLECTIVES,
    GlooAllGather,
    GlooReduceScatter,
    install_collectives,
    resolve_collectives,
    uses_gloo,
)

__all__ = [
    "COLLECTIVES",
    "GlooAllGather",
    "GlooReduceScatter",
    "install_collectives",
    "resolve_collectives",
    "uses_gloo",
]
