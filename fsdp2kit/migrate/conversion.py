"""What a converted config says: one `Entry` per source key (mapped, sent to the launch command, not
needed under FSDP2, or refused; an unknown key is refused), the recipe settings, the TOML and the launch."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["NO_GAIN", "RECIPE_KEYS", "ConfigConversionError", "Conversion", "Entry", "truthy"]

# The recipe keys a conversion may set: `recipes/train.py`'s dataclasses, restated here because the
# library never imports recipes/ (a test checks that every key below is still one of the recipe's).
RECIPE_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("meta_init",),
    "data": ("batch_size",),
    "parallel": (
        "shard",
        "replicate",
        "strategy",
        "mixed_precision",
        "cpu_offload",
        "prefetch",
        "activation_checkpointing",
        "compile",
        "float8",
    ),
    "train": ("steps", "lr", "warmup", "weight_decay", "grad_accum", "clip", "seed"),
    "checkpoint": (),
    "log": ("every",),
}

MAPPED, LAUNCH, NOT_NEEDED, REFUSED = "mapped", "launch", "not needed", "refused"
NO_GAIN = "nothing to convert (off / empty)"
SECTIONS = {LAUNCH: "Launch options", NOT_NEEDED: "Not needed under FSDP2", REFUSED: "REFUSED"}  # of the TOML's header


def truthy(value: Any) -> bool:
    """A YAML/JSON switch as accelerate and DeepSpeed read it: bools, strings such as "yes" / "true", or
    DeepSpeed's ``{"enabled": ...}`` blocks (a non-empty one is on unless it says otherwise)."""
    if isinstance(value, dict):
        return bool(value) and truthy(value.get("enabled", True))
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1", "on")
    return bool(value)


class ConfigConversionError(ValueError):
    """The source file cannot be read as the config it claims to be (not a refusal of one key)."""


@dataclass(frozen=True)
class Entry:
    """One source key and what became of it."""

    key: str  # dotted path in the source file, e.g. "fsdp_config.fsdp_sharding_strategy"
    value: Any
    verdict: str  # MAPPED, LAUNCH, NOT_NEEDED or REFUSED
    target: str = ""  # "parallel.strategy", or the torchrun option for LAUNCH
    note: str = ""  # the reason (not needed), the alternative (refused), or a difference to know


def _toml_value(value: Any) -> str:
    """A TOML value: JSON's spelling of a bool, an int, a finite float and a string is TOML's too."""
    if not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"no TOML form for {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} has no TOML form the recipe accepts")
    return json.dumps(value)


def _shown(value: Any) -> str:
    """A source value as it reads in a comment (one line)."""
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Conversion:
    """The result of converting one Accelerate or DeepSpeed config file."""

    source: str  # "Accelerate" or "DeepSpeed"
    path: str
    entries: list[Entry] = field(default_factory=list)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    nnodes: int | None = None
    nproc_per_node: int | None = None
    torchrun_options: list[str] = field(default_factory=list)  # beyond --nnodes / --nproc_per_node
    env: dict[str, str] = field(default_factory=dict)

    # ---- recording (used by the converters) ----

    def set(self, table: str, key: str, value: Any, src: str, src_value: Any, note: str = "") -> None:
        """Map source key ``src`` to recipe key ``table.key``; two sources must agree on a value."""
        if key not in RECIPE_KEYS.get(table, ()):
            raise AssertionError(f"{table}.{key} is not a recipe key this converter may set")
        values = self.settings.setdefault(table, {})
        if key in values and values[key] != value:
            why = f"conflicts with another key that set {table}.{key} = {_toml_value(values[key])}; "
            self.refuse(src, src_value, why + f"this one asks for {_toml_value(value)}: make the two agree")
            return
        values[key] = value
        self.entries.append(Entry(src, src_value, MAPPED, f"{table}.{key}", note))

    def launch(self, src: str, src_value: Any, target: str, note: str = "") -> None:
        self.entries.append(Entry(src, src_value, LAUNCH, target, note))

    def not_needed(self, src: str, src_value: Any, reason: str) -> None:
        self.entries.append(Entry(src, src_value, NOT_NEEDED, "", reason))

    def refuse(self, src: str, src_value: Any, alternative: str) -> None:
        self.entries.append(Entry(src, src_value, REFUSED, "", alternative))

    def refuse_if(self, on: bool, src: str, src_value: Any, alternative: str, otherwise: str = NO_GAIN) -> None:
        """Refused when ``on``; otherwise not needed (``otherwise`` says why)."""
        if on:
            self.refuse(src, src_value, alternative)
        else:
            self.not_needed(src, src_value, otherwise)

    def unknown(self, src: str, src_value: Any, known: list[str] | tuple[str, ...]) -> None:
        near = ", ".join(sorted(known)[:60])
        self.refuse(src, src_value, f"unknown {self.source} key: not converted (known here: {near})")

    def finish(self) -> Conversion:
        """Make the settings agree the way shard_model checks them: FULL_SHARD or SHARD_GRAD_OP with
        ``replicate > 1`` is HSDP, which shard_model names HYBRID_SHARD / HYBRID_SHARD_ZERO2."""
        parallel = self.settings.get("parallel", {})
        strategy = parallel.get("strategy")
        if parallel.get("replicate", 1) > 1 and strategy in _HYBRID:
            parallel["strategy"] = _HYBRID[strategy]
            why = f"{strategy} with replicate > 1 is HSDP, which shard_model calls {_HYBRID[strategy]}"
            self.entries = [
                replace(e, note=f"{e.note}; {why}" if e.note else why) if e.target == "parallel.strategy" else e
                for e in self.entries
            ]
        elif parallel.get("replicate", 1) > 1 and strategy == "NO_SHARD":
            self.refuse("parallel.replicate", parallel.pop("replicate"), "NO_SHARD replicates everywhere already")
        return self

    # ---- reading ----

    @property
    def refused(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict == REFUSED]

    def command(self, config_path: str = "CONFIG.toml", script: str = "recipes/train.py") -> str:
        """The torchrun line that runs the recipe with this conversion's TOML."""
        parts = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())] + ["torchrun"]
        if self.nnodes is not None and self.nnodes > 1:
            parts.append(f"--nnodes={self.nnodes}")
        parts += [f"--nproc_per_node={self.nproc_per_node or 'gpu'}", *self.torchrun_options]
        return " ".join([*parts, script, "--config", shlex.quote(config_path)])

    def to_toml(self, config_path: str = "CONFIG.toml") -> str:
        """The recipe TOML: a header that accounts for every source key, then the tables."""
        lines = [
            f"# Converted by `fsdp2kit convert-config` from {Path(self.path).name} ({self.source}).",
            "# Every key of the source is accounted for below: it sets the line it is quoted on,",
            "# goes to the launch command, is not needed under FSDP2 (and why), or was refused.",
            "#",
            "# Launch:",
            f"#   {self.command(config_path)}",
        ]
        for verdict, title in SECTIONS.items():
            chosen = [e for e in self.entries if e.verdict == verdict]
            lines += ["#", f"# {title}:"] if chosen else []
            for e in chosen:
                target = f" -> {e.target}" if e.target else ""
                lines.append(f"#   {e.key} = {_shown(e.value)}{target}")
                if e.note:
                    lines.append(f"#       {e.note}")
        for table, keys in RECIPE_KEYS.items():
            values = self.settings.get(table) or {}
            lines += ["", f"[{table}]"] if values else []
            for key in [k for k in keys if k in values]:
                sources = [e for e in self.entries if e.verdict == MAPPED and e.target == f"{table}.{key}"]
                quoted = "; ".join(f"{e.key} = {_shown(e.value)}" for e in sources)
                lines.append(f"{key} = {_toml_value(values[key])}  # {quoted}")
                lines += [f"# {n}" for n in dict.fromkeys(e.note for e in sources if e.note)]
        return "\n".join(lines) + "\n"


# What becomes of one source key: a string is why it is not needed; a function(conv, src, value) records it.
Rule = str | Callable[[Conversion, str, Any], None]


def apply_rules(
    conv: Conversion, cfg: dict, rules: dict[str, Rule], prefix: str = "", written: dict | None = None
) -> None:
    """Each key of ``cfg``, in its order, by its rule (``written``: a key's spelling in the file, when
    another); a key without a rule is refused as unknown."""
    for key, value in cfg.items():
        src = prefix + (written or {}).get(key, key)
        rule = rules.get(key)
        if rule is None:
            conv.unknown(src, value, list(rules))
        elif isinstance(rule, str):
            conv.not_needed(src, value, rule)
        else:
            rule(conv, src, value)


def refused_when(on: Callable[[Any], bool], why: str, otherwise: str = NO_GAIN) -> Rule:
    """Refused (``why`` says what to do instead) when ``on(value)``; otherwise not needed (``otherwise``)."""
    return lambda conv, src, value: conv.refuse_if(on(value), src, value, why, otherwise)


def mapped(table: str, key: str, cast: Callable[[Any], Any] = lambda v: v, note: str = "") -> Rule:
    """Sets recipe key ``table.key`` to ``cast(value)``."""
    return lambda conv, src, value: conv.set(table, key, cast(value), src, value, note)


_HYBRID = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "HYBRID_SHARD_ZERO2"}
