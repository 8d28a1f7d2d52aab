"""Recipe plumbing: TOML configs with overrides and clear errors; packing and a resumable loader."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from support.config import ConfigError, parse_config
from support.data import ByteTokenizer, PackedDataset, ResumableLoader, demo_corpus, read_texts, tokenize


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


def test_tokenize_and_pack():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    docs = demo_corpus(50, seed=1)
    assert docs == demo_corpus(50, seed=1) and docs != demo_corpus(50, seed=2)
    ids = tokenize(docs, tok)
    ds = PackedDataset(ids, seq_len=16)
    assert len(ds) == (ids.numel() - 1) // 16
    assert torch.equal(ds[1][:1], ds[0][-1:])  # windows overlap by the one shifted token
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedDataset(ids[:10], seq_len=16)


def test_read_texts(tmp_path):
    (tmp_path / "a.txt").write_text("doc one")
    (tmp_path / "b.jsonl").write_text('{"text": "doc two"}\n\n{"text": "doc three"}\n')
    assert read_texts([tmp_path / "a.txt", tmp_path / "b.jsonl"]) == ["doc one", "doc two", "doc three"]
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(KeyError, match="c.jsonl:1 has no field 'text'"):
        read_texts([tmp_path / "c.jsonl"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_texts([tmp_path / "nope.txt"])


def test_loader_splits_reshuffles_and_resumes():
    ds = PackedDataset(torch.arange(2 * 4 * 5 * 3 + 1), seq_len=1)  # 120 one-token windows
    ranks = [ResumableLoader(ds, 4, rank=r, world_size=2, seed=0) for r in range(2)]
    per_epoch = len(ranks[0].loader)
    epochs = [[b[:, 0].tolist() for b in itertools.islice(iter(r), 2 * per_epoch)] for r in ranks]
    first = {x for batch in epochs[0][:per_epoch] for x in batch}
    second = {x for batch in epochs[1][:per_epoch] for x in batch}
    assert not first & second  # ranks read disjoint parts
    assert epochs[0][:per_epoch] != epochs[0][per_epoch:]  # the next epoch is reshuffled

    a = ResumableLoader(ds, 4, rank=0, world_size=2, seed=0)
    it = iter(a)
    head = [next(it) for _ in range(per_epoch + 2)]  # into the second epoch
    state = a.state_dict()
    rest = [next(it) for _ in range(3)]
    b = ResumableLoader(ds, 4, rank=0, world_size=2, seed=0)
    b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(rest, itertools.islice(iter(b), 3)))
    assert state == {"epoch": 1, "index": 2} and len(head) == per_epoch + 2
    with pytest.raises(ValueError, match="give no full batch"):
        ResumableLoader(PackedDataset(torch.arange(5), seq_len=1), 4, rank=0, world_size=2)
