"""Language-model data: a byte tokenizer, an embedded demo corpus, packing, and a resumable loader.

Nothing here touches the network: the demo corpus is generated, the byte tokenizer needs no
files, and real data comes from local text/JSONL files and a local tokenizer directory.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["ByteTokenizer", "PackedDataset", "ResumableLoader", "demo_corpus", "read_texts", "tokenize"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no vocabulary file. Id 0 (NUL) separates documents."""

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


_SUBJECTS = [
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "the robot",
    "a small bird",
    "the teacher",
    "our neighbour",
]
_VERBS = ["sees", "likes", "follows", "paints", "finds", "carries", "visits", "remembers"]
_OBJECTS = [
    "the red ball",
    "a quiet garden",
    "the long river",
    "an open door",
    "the blue house",
    "a warm loaf of bread",
]
_PLACES = ["in the morning", "after the rain", "near the station", "every sunday", "before dinner", "under the bridge"]


def demo_corpus(n_documents: int = 2000, seed: int = 0) -> list[str]:
    """A generated English-like corpus with real structure (grammar, agreement, repetition).

    A byte-level model learns spelling within a few hundred steps and the sentence pattern soon
    after, so the loss falls visibly on a CPU in a minute: the point of the demo.
    """
    rng = random.Random(seed)
    docs = []
    for _ in range(n_documents):
        sentences = []
        for _ in range(rng.randint(2, 5)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
            sentences.append(s[0].upper() + s[1:])
        docs.append(" ".join(sentences))
    return docs


def read_texts(paths: list[str | Path], *, text_field: str = "text") -> list[str]:
    """Documents from local ``.txt`` files (one document per file) and ``.jsonl`` files (one per line)."""
    docs: list[str] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"data file {p} does not exist")
        if p.suffix == ".jsonl":
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if line.strip():
                    record = json.loads(line)
                    if text_field not in record:
                        raise KeyError(f"{p}:{n} has no field {text_field!r} (fields: {sorted(record)})")
                    docs.append(record[text_field])
        else:
            docs.append(p.read_text())
    return docs


def tokenize(docs: list[str], tokenizer, eos_id: int | None = None) -> torch.Tensor:
    """One long 1-D tensor of token ids, documents separated by the end-of-sequence id."""
    eos = eos_id if eos_id is not None else getattr(tokenizer, "eos_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer.encode(d))
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class PackedDataset(Dataset):
    """Fixed-length training windows cut from one token stream (packing: no padding is wasted).

    Item i is ``seq_len + 1`` tokens, so inputs are ``item[:-1]`` and targets ``item[1:]``.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int):
        if ids.numel() < seq_len + 1:
            raise ValueError(f"the data has {ids.numel()} tokens, fewer than one sequence of {seq_len + 1}")
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return (self.ids.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return self.ids[start : start + self.seq_len + 1]


class ResumableLoader:
    """Endless batches over epochs, reshuffled each epoch, each rank reading its own part.

    Its position (epoch, batch within the epoch) is a ``state_dict``, so a resumed run continues
    with exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int = 0):
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, drop_last=True)
        if len(self.loader) == 0:
            raise ValueError(
                f"{len(dataset)} sequences split over {world_size} ranks give no full batch of {batch_size}: "
                "use more data, a shorter seq_len or a smaller batch"
            )
        self.epoch, self.index = 0, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.sampler.set_epoch(self.epoch)
            for i, batch in enumerate(self.loader):
                if i < self.index:
                    continue  # resuming mid-epoch: skip what was already consumed
                self.index = i + 1
                yield batch
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
