"""Helpers shared by fsdp2kit's layers; not part of the public API."""
