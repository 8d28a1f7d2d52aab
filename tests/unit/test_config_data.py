"""Recipe plumbing: TOML configs with overrides and clear errors (the data: test_finetune_data.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from support.config import ConfigError, parse_config


@dataclass
class A:
    lr: float = field(default=0.1, metadata={"help": "learning rate, decays to 10% of itself"})
    steps: int = 10
    name: str | None = None
    flag: bool = False


@dataclass
class Cfg:
    a: A = field(default_factory=A)


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[a]\nlr = 0.5\nsteps = 3\nname = "x"\n')
    cfg = parse_config(Cfg, ["--config", str(f), "--a.steps", "7", "--a.flag", "true"])
    assert cfg == Cfg(A(lr=0.5, steps=7, name="x", flag=True))
    assert parse_config(Cfg, ["--a.name", "none"]).a.name is None
    assert parse_config(Cfg, []) == Cfg()


def test_config_errors(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text("[a]\nlearning_rate = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key a.learning_rate; keys of \[a\]: flag, lr, name, steps"):
        parse_config(Cfg, ["--config", str(f)])
    f.write_text("[b]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown table \[b\]; known tables: a"):
        parse_config(Cfg, ["--config", str(f)])
    f.write_text("[a\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_config(Cfg, ["--config", str(f)])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(Cfg, ["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match=r"a.steps='many' is not a valid int"):
        parse_config(Cfg, ["--a.steps", "many"])
    with pytest.raises(ConfigError, match=r"a.steps=1.5 is not a valid int"):
        f.write_text("[a]\nsteps = 1.5\n")
        parse_config(Cfg, ["--config", str(f)])
    with pytest.raises(SystemExit):
        parse_config(Cfg, ["--a.nope", "1"])
    assert "unrecognized arguments: --a.nope" in capsys.readouterr().err


def test_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit):
        parse_config(Cfg, ["--help"])
    out = capsys.readouterr().out
    assert (
        "--a.lr FLOAT" in out
        and "learning rate, decays to 10% of itself (default: 0.1)" in out
        and "--a.flag BOOL" in out
    )
