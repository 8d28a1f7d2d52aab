"""Dataclass configs from TOML files with command-line overrides.

A config is a dataclass whose fields are dataclasses (the TOML tables) of plain values. A file
sets any subset; ``--table.key value`` on the command line overrides it; ``--help`` lists every
key with its type, default and the help text from ``field(metadata={"help": ...})``. Unknown
tables or keys are errors that name them (and the nearest known one): a typo in a config must
never be silently ignored, and no option is taken for an abbreviation of another.

A field's metadata may also say which values it takes: ``choices`` (matched ignoring case and
stored as spelled there), ``check`` (a function that returns the value to store or raises
``ValueError`` saying why) and ``minimum``. They are checked here, for the TOML file and the
command line alike, so every mistake reads the same: ``table.key = value (from where): why``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from support.errors import ConfigError

__all__ = ["ConfigError", "config_to_dict", "parse_config"]

T = TypeVar("T")
COMMAND_LINE = "the command line"


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


def _suggest(word: str, known: typing.Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as the field's type; ``ValueError`` saying why not."""
    scalar, optional = _leaf_type(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError("cannot be none")
    if typing.get_origin(scalar) is typing.Union or scalar is typing.Any:
        return value
    name = getattr(scalar, "__name__", str(scalar))
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
        raise ValueError(f"not a valid {name}" + (" (true or false)" if scalar is bool else "")) from None


def _check(value: Any, meta: typing.Mapping[str, Any]) -> Any:
    """The field's own rules from its metadata (choices, check, minimum); the value to store."""
    if value is None:
        return None
    choices = meta.get("choices")
    if choices:
        by_key = {str(c).lower(): c for c in choices}
        if str(value).lower() not in by_key:
            close = _suggest(str(value).lower(), by_key)
            hint = f"; did you mean {by_key[close]}?" if close else ""
            raise ValueError(f"expected one of {', '.join(map(str, choices))}{hint}")
        value = by_key[str(value).lower()]
    if "minimum" in meta and value < meta["minimum"]:
        raise ValueError(f"must be >= {meta['minimum']}")
    if "check" in meta:
        value = meta["check"](value)
    return value


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _Parser(argparse.ArgumentParser):
    """argparse that raises `ConfigError` instead of printing its usage, and prints --help on rank 0 only."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see --help)")

    def _print_message(self, message: str, file: Any = None) -> None:
        if _rank() == 0:  # under torchrun every rank parses: one copy of --help is enough
            super()._print_message(message, file)


def _unknown(extras: list[str], options: list[str]) -> ConfigError:
    """The first unknown command-line word as a `ConfigError`, naming the nearest known option."""
    word = extras[0]
    if not word.startswith("-"):
        return ConfigError(f"unexpected argument {word!r} on the command line: options take the form --table.key VALUE")
    name = word.split("=", 1)[0]
    close = _suggest(name, options)
    hint = f"; did you mean {close}?" if close else "; see --help for the options"
    return ConfigError(f"unknown option {name}{hint}")


def parse_config(cls: type[T], argv: list[str] | None = None, *, description: str = "", prog: str | None = None) -> T:
    """Build ``cls`` from ``--config FILE`` (TOML) and ``--table.key value`` overrides."""
    parser = _Parser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # --train.step must not quietly mean --train.steps
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file; command-line options override it")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the Python traceback of a config, data or model mistake (also: FSDP2KIT_DEBUG=1)",
    )
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
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise _unknown(extras, [o for a in parser._actions for o in a.option_strings if o.startswith("--")])
    args = vars(args)
    args.pop("debug", None)  # read before parsing, by support.errors.run_recipe

    values: dict[str, dict[str, Any]] = {t: {} for t in _tables(cls)}
    where: dict[str, str] = {}
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
                close = _suggest(table, values)
                hint = f"did you mean [{close}]?" if close else f"known tables: {', '.join(values)}"
                raise ConfigError(f"{path}: unknown table [{table}]; {hint}")
            if not isinstance(entries, dict):
                raise ConfigError(f"{path}: {table} must be a table ([{table}]), got {entries!r}")
            known = sorted(f.name for f in dataclasses.fields(_tables(cls)[table]))
            for key, value in entries.items():
                if key not in known:
                    close = _suggest(key, known)
                    hint = f"did you mean {table}.{close}?" if close else f"keys of [{table}]: {', '.join(known)}"
                    raise ConfigError(f"{path}: unknown key {table}.{key}; {hint}")
                values[table][key] = value
                where[f"{table}.{key}"] = str(path)
    for dotted, value in args.items():
        table, key = dotted.split(".", 1)
        values[table][key] = value
        where[dotted] = COMMAND_LINE

    tables = {}
    for table, table_cls in _tables(cls).items():
        hints = typing.get_type_hints(table_cls)
        fields = {f.name: f for f in dataclasses.fields(table_cls)}
        kwargs = {}
        for k, v in values[table].items():
            try:
                kwargs[k] = _check(_coerce(v, hints[k]), fields[k].metadata)
            except ValueError as e:
                raise ConfigError(f"{table}.{k} = {v!r} (from {where[f'{table}.{k}']}): {e}") from None
        tables[table] = dataclasses.replace(getattr(defaults, table), **kwargs)
    return cls(**tables)
