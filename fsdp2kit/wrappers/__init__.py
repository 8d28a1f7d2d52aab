"""Speed and memory wrappers that change blocks in place: float8, activation checkpointing, compile, prefetch."""
