"""Numbers and lists as people read them in tables and error messages."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_list(items: list[str], limit: int = 12) -> str:
    """The first ``limit`` items of a list for an error message, and how many there are in all."""
    shown = ", ".join(map(str, items[:limit]))
    return f"{shown}, ... ({len(items)} in all)" if len(items) > limit else shown


def key_problems(missing=(), unexpected=(), mismatched=(), *, source="the checkpoint", holder="the model") -> list[str]:
    """How a model's keys and a file's differ, one phrase per kind that occurs, each naming the keys."""
    problems = [f"shape mismatch: {fmt_list(list(mismatched), 8)}"] if mismatched else []
    if missing:
        problems.append(f"{len(missing)} key(s) missing from {source}: {fmt_list(list(missing))}")
    if unexpected:
        problems.append(f"{len(unexpected)} key(s) in {source} that {holder} lacks: {fmt_list(list(unexpected))}")
    return problems


def fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
