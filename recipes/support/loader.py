"""Batches of packed rows for training: shuffled each epoch, each rank its own rows, resumable mid-epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

__all__ = ["ResumableLoader", "SplitBatches", "to_batch"]


def to_batch(rows: dict, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Rows as a dict of lists (a `datasets` slice) -> long tensors on ``device``."""
    return {k: torch.as_tensor(rows[k], dtype=torch.long).to(device) for k in ("input_ids", "labels", "position_ids")}


class ResumableLoader:
    """Endless batches over epochs, reshuffled each epoch, each rank reading its own rows.

    Its position (epoch, batch within the epoch) is a ``state_dict``: a resumed run continues with
    exactly the batches an uninterrupted run would have seen, and skipping to the middle of an
    epoch costs nothing (the order is an index permutation, no row is read to be thrown away).
    Rows that do not fill a batch on every rank are left out of that epoch (a different few each epoch).
    """

    def __init__(self, rows, batch_size: int, *, rank: int, world_size: int, seed: int = 0):
        self.rows, self.batch_size, self.rank, self.world_size, self.seed = rows, batch_size, rank, world_size, seed
        self.per_rank = len(rows) // world_size // batch_size
        if self.per_rank == 0:
            raise ValueError(
                f"{len(rows)} sequences split over {world_size} ranks give no full batch of {batch_size}: "
                "use more data, a shorter seq_len or a smaller batch"
            )
        self.epoch, self.index = 0, 0

    def __len__(self) -> int:
        return self.per_rank

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.rows), generator=g)
        return order[self.rank : self.per_rank * self.batch_size * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            order = self._order(self.epoch)
            while self.index < self.per_rank:
                take = order[self.index * self.batch_size : (self.index + 1) * self.batch_size].tolist()
                self.index += 1
                yield to_batch(self.rows[take])
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class SplitBatches:
    """A loader's batches, each cut to this rank's part of the sequences (context parallelism: the ranks of
    one cp group read the same rows and keep their own chunks). Its position is the loader's."""

    def __init__(self, loader: ResumableLoader, split: Callable[[dict], dict]):
        self.loader, self.split = loader, split

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self.split(b) for b in self.loader)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)
