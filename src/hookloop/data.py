"""Data order that can be reproduced and resumed.

A map-style dataset handed to the Trainer is wrapped in a DataLoader over an
:class:`EpochSampler`: the shuffle order is a pure function of (seed, epoch),
every rank takes its own equal-sized share, and a resumed run starts the epoch
at the exact sample where the checkpoint left off, without replaying compute.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sized
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

    def order(self) -> list[int]:
        """This rank's indices of the selected epoch, in order (the skipped ones too)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        per_rank = self.length // self.world_size
        # Every rank gets the same count (the tail is dropped) so no rank waits on another.
        return order[self.rank : per_rank * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start :])


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


class DataPosition:
    """Where the training data stands, as a named checkpoint state, and how an epoch resumes.

    Three kinds of train data resume differently:

    - a loader over an :class:`EpochSampler` (what a map-style dataset becomes):
      the epoch's order is recomputed and the sampler starts at the exact sample;
    - a loader with ``state_dict()`` / ``load_state_dict()`` (e.g. torchdata's
      ``StatefulDataLoader``): its own state is saved and restored;
    - anything else: the batches already trained on are read again and dropped,
      with a warning, which is exact only if the data comes in the same order.
    """

    def __init__(self, loader: Iterable[Any], grad_accum: int) -> None:
        self.loader = loader
        self.grad_accum = grad_accum
        self._positioned = False  # the loader's own state was restored

    def state_dict(self) -> dict[str, Any]:
        if callable(getattr(self.loader, "state_dict", None)):
            return {"loader": self.loader.state_dict()}  # type: ignore[attr-defined]
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loader" in state and hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(state["loader"])
            self._positioned = True

    def epoch(self, epoch: int, epoch_step: int) -> Iterator[Any]:
        """Micro-batches of ``epoch``, starting after ``epoch_step`` optimizer steps."""
        loader = self.loader
        sampler = getattr(loader, "sampler", None)
        consumed = epoch_step * self.grad_accum
        positioned, self._positioned = self._positioned, False
        if isinstance(sampler, EpochSampler):
            sampler.set_epoch(epoch, start=consumed * (loader.batch_size or 1))  # type: ignore[attr-defined]
        elif hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
        batches = _opened(loader, keep_rng=epoch_step > 0)
        if isinstance(sampler, EpochSampler):
            return batches
        if consumed and not positioned:
            warnings.warn(
                f"hookloop resume: the train data ({type(loader).__name__}) cannot be positioned "
                f"mid-epoch, so {consumed} already-trained batches are read and dropped; the "
                "resume is exact only if the data comes in the same order every run. Pass a "
                "map-style Dataset (hookloop shuffles it reproducibly) or a loader with "
                "state_dict()/load_state_dict() (e.g. torchdata's StatefulDataLoader).",
                stacklevel=3,
            )
            batches = itertools.islice(batches, consumed, None)
        return batches


def _opened(loader: Iterable[Any], *, keep_rng: bool) -> Iterator[Any]:
    """``iter(loader)``. A DataLoader without a generator of its own draws its workers'
    seed from torch's global RNG as it opens; resumed mid-epoch, the checkpoint's RNG
    state already follows the draw the interrupted run made when it opened the epoch,
    so with ``keep_rng`` this one is undone and dropout goes on as it would have."""
    if not keep_rng:
        return iter(loader)
    state = torch.get_rng_state()
    batches = iter(loader)
    torch.set_rng_state(state)
    return batches
