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
    with pytest.raises(ConfigError, match=r"unknown key a.learning_rate; keys of \[a\]: flag, lr, name, steps$"):
        parse_config(Cfg, ["--config", str(f)])
    f.write_text("[a]\nstpes = 1\n")
    with pytest.raises(ConfigError, match=r"c.toml: unknown key a.stpes; did you mean a.steps\?$"):
        parse_config(Cfg, ["--config", str(f)])
    f.write_text("[b]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown table \[b\]; known tables: a"):
        parse_config(Cfg, ["--config", str(f)])
    f.write_text("[a\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_config(Cfg, ["--config", str(f)])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(Cfg, ["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match=r"^a.steps = 'many' \(from the command line\): not a valid int$"):
        parse_config(Cfg, ["--a.steps", "many"])
    f.write_text("[a]\nsteps = 1.5\n")
    with pytest.raises(ConfigError, match=rf"^a.steps = 1.5 \(from {f}\): not a valid int$"):
        parse_config(Cfg, ["--config", str(f)])
    # argparse's own errors are ConfigErrors too, not its usage text on stderr
    with pytest.raises(ConfigError, match=r"^unknown option --a.nope; did you mean --a.name\?$"):
        parse_config(Cfg, ["--a.nope", "1"])
    with pytest.raises(ConfigError, match=r"^unknown option --quiet; see --help for the options$"):
        parse_config(Cfg, ["--quiet"])
    with pytest.raises(ConfigError, match=r"^unknown option --a.stpes; did you mean --a.steps\?$"):
        parse_config(Cfg, ["--a.stpes=1"])
    with pytest.raises(ConfigError, match=r"^unknown option --a.step; did you mean --a.steps\?$"):
        parse_config(Cfg, ["--a.step", "1"])  # no abbreviations: --a.step is not --a.steps
    with pytest.raises(ConfigError, match=r"^unexpected argument '3' on the command line"):
        parse_config(Cfg, ["--a.steps", "2", "3"])
    with pytest.raises(ConfigError, match=r"^argument --a.steps: expected one argument \(see --help\)$"):
        parse_config(Cfg, ["--a.steps"])
    assert capsys.readouterr().err == ""


def _even(value: int) -> int:
    if value % 2:
        raise ValueError("odd")
    return value


@dataclass
class B:
    mode: str = field(default="fast", metadata={"choices": ("fast", "SLOW")})
    n: int = field(default=1, metadata={"minimum": 1})
    even: int = field(default=2, metadata={"check": _even})


@dataclass
class CfgB:
    b: B = field(default_factory=B)


def test_field_rules_read_the_same_from_the_file_and_the_command_line(tmp_path):
    assert parse_config(CfgB, ["--b.mode", "slow"]).b.mode == "SLOW"  # any case, stored as the choice spells it
    f = tmp_path / "c.toml"
    f.write_text('[b]\nmode = "slwo"\n')
    why = r"b.mode = 'slwo' \(from {}\): expected one of fast, SLOW; did you mean SLOW\?$"
    with pytest.raises(ConfigError, match="^" + why.format(f)):
        parse_config(CfgB, ["--config", str(f)])
    with pytest.raises(ConfigError, match="^" + why.format("the command line")):
        parse_config(CfgB, ["--b.mode", "slwo"])
    with pytest.raises(ConfigError, match=r"^b.n = '0' \(from the command line\): must be >= 1$"):
        parse_config(CfgB, ["--b.n", "0"])
    with pytest.raises(ConfigError, match=r"^b.even = 3 \(from .*c.toml\): odd$"):
        f.write_text("[b]\neven = 3\n")
        parse_config(CfgB, ["--config", str(f)])


def test_help_comes_from_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        parse_config(Cfg, ["--help"])
    assert capsys.readouterr().out == ""


def test_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit):
        parse_config(Cfg, ["--help"])
    out = capsys.readouterr().out
    assert (
        "--a.lr FLOAT" in out
        and "learning rate, decays to 10% of itself (default: 0.1)" in out
        and "--a.flag BOOL" in out
    )
