"""Dataclass configs from TOML files with command-line overrides.

A config is a dataclass whose fields are dataclasses (the TOML tables) of plain values. A file
sets any subset; ``--table.key value`` on the command line overrides it; ``--help`` lists every
key with its type, default and the help text from ``field(metadata={"help": ...})``. Unknown
tables or keys are errors that name them: a typo in a config must never be silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "config_to_dict", "parse_config"]

T = TypeVar("T")


class ConfigError(ValueError):
    pass


def _tables(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _leaf_type(tp: Any) -> tuple[type, bool]:
    """(the scalar type to parse with, whether None is allowed)."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), True
    return tp, False


def _coerce(value: Any, tp: Any, key: str) -> Any:
    scalar, optional = _leaf_type(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{key} cannot be none")
    if typing.get_origin(scalar) is typing.Union or scalar is typing.Any:
        return value
    try:
        if scalar is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
            raise ValueError
        if scalar is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        if scalar in (int, float) and isinstance(value, bool):
            raise ValueError
        return scalar(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is not a valid {getattr(scalar, '__name__', scalar)}") from None


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def parse_config(cls: type[T], argv: list[str] | None = None, *, description: str = "", prog: str | None = None) -> T:
    """Build ``cls`` from ``--config FILE`` (TOML) and ``--table.key value`` overrides."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file; command-line options override it")
    defaults = cls()
    for table, table_cls in _tables(cls).items():
        group = parser.add_argument_group(f"[{table}]")
        for f in dataclasses.fields(table_cls):
            default = getattr(getattr(defaults, table), f.name)
            scalar, _ = _leaf_type(typing.get_type_hints(table_cls)[f.name])
            help_text = f.metadata.get("help", "")
            group.add_argument(
                f"--{table}.{f.name}",
                dest=f"{table}.{f.name}",
                metavar=getattr(scalar, "__name__", "VALUE").upper(),
                help=f"{help_text} (default: {default!r})".replace("%", "%%"),  # argparse %-formats help
            )
    args = vars(parser.parse_args(argv))

    values: dict[str, dict[str, Any]] = {t: {} for t in _tables(cls)}
    if "config" in args:
        path = Path(args.pop("config"))
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for table, entries in data.items():
            if table not in values:
                raise ConfigError(f"{path}: unknown table [{table}]; known tables: {', '.join(values)}")
            if not isinstance(entries, dict):
                raise ConfigError(f"{path}: {table} must be a table ([{table}]), got {entries!r}")
            known = {f.name for f in dataclasses.fields(_tables(cls)[table])}
            for key, value in entries.items():
                if key not in known:
                    raise ConfigError(
                        f"{path}: unknown key {table}.{key}; keys of [{table}]: {', '.join(sorted(known))}"
                    )
                values[table][key] = value
    for dotted, value in args.items():
        table, key = dotted.split(".", 1)
        values[table][key] = value

    tables = {}
    for table, table_cls in _tables(cls).items():
        hints = typing.get_type_hints(table_cls)
        kwargs = {k: _coerce(v, hints[k], f"{table}.{k}") for k, v in values[table].items()}
        tables[table] = dataclasses.replace(getattr(defaults, table), **kwargs)
    return cls(**tables)
