"""Data order that can be reproduced and resumed.

A map-style dataset handed to the Trainer is wrapped in a DataLoader over an
:class:`EpochSampler`: the shuffle order is a pure function of (seed, epoch),
every rank takes its own equal-sized share, and a resumed run starts the epoch
at the exact sample where the checkpoint left off, without replaying compute.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler


class EpochSampler(Sampler[int]):
    """Indices for one epoch: seeded shuffle, per-rank share, resumable offset."""

    def __init__(
        self,
        length: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if length < 1:
            raise ValueError(f"EpochSampler needs a non-empty dataset, got length {length}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        self.length = length
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0  # samples of this rank's share already consumed this epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch (its order) and how many of its samples to skip."""
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.length // self.world_size

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        per_rank = self.length // self.world_size
        # Every rank gets the same count (the tail is dropped) so no rank waits on another.
        return order[self.rank : per_rank * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.start :])


def is_map_style(data: Any) -> bool:
    """A dataset with ``__len__`` and ``__getitem__`` (and not already a loader)."""
    return (
        isinstance(data, Dataset)
        and not isinstance(data, IterableDataset)
        and isinstance(data, Sized)
    )


def make_loader(
    dataset: Any,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    rank: int,
    world_size: int,
    num_workers: int,
    drop_last: bool,
) -> DataLoader:
    sampler = EpochSampler(
        len(dataset), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        drop_last=drop_last,
        # Its own generator: creating an iterator must not draw from the global torch
        # RNG, or a resumed run's dropout masks would differ from an uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
    )
