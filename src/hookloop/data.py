"""Data order that can be reproduced and resumed, and what the loop takes as a batch.

The rule: **a sized indexable is a dataset of rows, any other iterable yields batches.**
A dataset (a torch map-style ``Dataset``, a Hugging Face ``datasets.Dataset``, or any
object with ``__getitem__`` and ``__len__`` that is not a list or tuple) is wrapped in a
DataLoader over an :class:`EpochSampler`: batched by ``data.batch_size``, its rows put
together by :func:`collate_rows`, shuffled as a pure function of (seed, epoch), every
rank taking its own equal-sized share, and a resumed run starting the epoch at the exact
sample where the checkpoint left off, without replaying compute. A DataLoader, a list or
tuple, a generator or any other iterable is taken as batches as they come; one whose
first item looks like a single row (:func:`looks_like_a_row`) is refused.
"""

from __future__ import annotations

import itertools
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from hookloop.errors import ConfigError


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
        #: Where a ledger (:mod:`hookloop.ledger`) wants (position, index, epoch) of each
        #: index dealt; None: not recorded.
        self.recorder: Any = None

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
        if self.recorder is None:
            return iter(self.order()[self.start :])
        return self._recorded(self.order())

    def _recorded(self, order: list[int]) -> Iterator[int]:
        record, epoch = self.recorder.append, self.epoch
        for position in range(self.start, len(order)):
            record((position, order[position], epoch))
            yield order[position]


#: Sized indexables taken as batches (or refused), never as datasets of rows.
_NOT_DATASETS = (list, tuple, str, bytes, Mapping, torch.Tensor, np.ndarray, DataLoader)


def is_map_style(data: Any) -> bool:
    """A dataset of rows: ``__getitem__`` and ``__len__``, and not a list or tuple of
    batches, a loader, a mapping, a tensor or an array (see the module doc)."""
    if isinstance(data, (IterableDataset, *_NOT_DATASETS)):
        return False
    if isinstance(data, Dataset):
        return isinstance(data, Sized)
    return callable(getattr(data, "__getitem__", None)) and callable(getattr(data, "__len__", None))


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
    collate_fn: Callable[[list[Any]], Any] | None = None,
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
        collate_fn=collate_fn or collate_rows,
        # Its own generator: creating an iterator must not draw from the global torch
        # RNG, or a resumed run's dropout masks would differ from an uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
    )


# -- putting rows together ---------------------------------------------------------------


def collate_rows(rows: list[Any]) -> Any:
    """One batch from a list of rows, the way torch's ``default_collate`` does, except
    that a field holding a list of numbers (a ``datasets.Dataset`` row's ``input_ids``)
    becomes one tensor ``[batch, length]`` instead of ``length`` tensors.

    A row is a mapping (batched key by key), a tuple (batched position by position), or
    a value: a tensor or array (stacked), a number (a tensor of them), a list of numbers
    (a tensor; every row's list must have the same length), a string (a list of them).

    >>> collate_rows([{"ids": [1, 2], "y": 0}, {"ids": [3, 4], "y": 1}])
    {'ids': tensor([[1, 2],
            [3, 4]]), 'y': tensor([0, 1])}
    """
    return _collate(rows, "")


def _collate(values: list[Any], where: str) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        return {key: _collate([v[key] for v in values], _name(where, key)) for key in first}
    if isinstance(first, tuple):
        fields = [
            _collate(list(col), _name(where, i)) for i, col in enumerate(zip(*values, strict=True))
        ]
        return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)
    if isinstance(first, list):
        if _all_numbers(first):
            return _number_lists(values, where)
        fields = [
            _collate(list(col), _name(where, i)) for i, col in enumerate(zip(*values, strict=True))
        ]
        return fields
    if isinstance(first, (torch.Tensor, np.ndarray)):
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(_unequal(where, sorted(shapes)[:2]))
    return default_collate(values)


def _number_lists(values: list[list[Any]], where: str) -> torch.Tensor:
    lengths = sorted({len(v) for v in values})
    if len(lengths) > 1:
        raise ValueError(_unequal(where, lengths[:2]))
    return torch.tensor(values)


def _all_numbers(items: list[Any]) -> bool:
    return all(isinstance(x, numbers.Number) and not isinstance(x, bool) for x in items) or all(
        isinstance(x, list) and _all_numbers(x) for x in items
    )


def _name(where: str, key: Any) -> str:
    return f"{where}[{key!r}]" if where else repr(key)


def _unequal(where: str, sizes: list[Any]) -> str:
    field = f"field {where}" if where else "the rows"
    return (
        f"cannot batch the data: {field} differs in size between rows of one batch "
        f"({sizes[0]} and {sizes[1]}); pad them to one length (e.g. with the tokenizer's "
        "padding='max_length') or pass collate_fn=... to the Trainer"
    )


def looks_like_a_row(item: Any) -> bool:
    """Whether an item an iterable yielded is a single row rather than a batch: a number,
    a string or a 0-dim tensor; a mapping of such values or of lists (a
    ``datasets.Dataset`` row); a tuple holding a number or a 0-dim tensor (a torch
    dataset's ``(features, label)``). A batch's tensors all have a batch dimension."""
    if _is_scalar(item):
        return True
    if isinstance(item, Mapping):
        return bool(item) and all(_is_scalar(v) or isinstance(v, list) for v in item.values())
    if isinstance(item, tuple):
        return any(_is_scalar(v) for v in item)
    return False


def _is_scalar(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 0
    return isinstance(value, (numbers.Number, str))


def check_batches(batches: Iterator[Any], what: str) -> Iterator[Any]:
    """``batches``, refusing them when the first is a single row (see the module doc)."""
    first = next(batches, _END)
    if first is _END:
        return iter(())
    if looks_like_a_row(first):
        raise TypeError(
            f"the {what} data yields single rows (its first item is a "
            f"{type(first).__name__} of values without a batch dimension), not batches: "
            "pass the dataset itself (an object with __getitem__ and __len__; hookloop "
            "batches it by data.batch_size) or a DataLoader(dataset, batch_size=...)"
        )
    return itertools.chain((first,), batches)


_END = object()


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

    def __init__(
        self,
        loader: Iterable[Any],
        grad_accum: int,
        *,
        check_rows: bool = False,
        world_size: int = 1,
    ) -> None:
        self.loader = loader
        self.grad_accum = grad_accum
        self.check_rows = check_rows  # refuse an iterable that yields rows (the native loop)
        self.world_size = world_size
        self._positioned = False  # the loader's own state was restored
        #: The world size the restored checkpoint was saved with, when it was another one.
        self.resized_from: int | None = None

    def layout(self) -> dict[str, Any]:
        """How the data is dealt: ranks, per-rank batch, micro-batches per step."""
        return {
            "world_size": self.world_size,
            "batch_size": getattr(self.loader, "batch_size", None),
            "grad_accum": self.grad_accum,
        }

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"layout": self.layout()}
        if callable(getattr(self.loader, "state_dict", None)):
            state["loader"] = self.loader.state_dict()  # type: ignore[attr-defined]  # checked above
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("layout")  # absent in older checkpoints: not checked
        exact = isinstance(self.sampler, EpochSampler)
        # The native loop keeps its global batch; a dialect may change it on a resume as its
        # original allows (transformers warns), so only a change of ranks is checked there.
        if (
            saved is not None
            and saved != self.layout()
            and ((exact and self.check_rows) or saved.get("world_size") != self.world_size)
        ):
            check_resize(saved, self.layout(), exact=exact, stateful="loader" in state)
            if saved["world_size"] != self.world_size:
                self.resized_from = saved["world_size"]
        if "loader" in state and hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(state["loader"])
            self._positioned = True

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    def epoch(self, epoch: int, epoch_step: int, *, rng_held: bool = False) -> Iterator[Any]:
        """Micro-batches of ``epoch``, starting after ``epoch_step`` optimizer steps.
        ``rng_held``: the resume's generators are not restored yet (:class:`RNGState`'s
        hold), so what opening the loader draws stays drawn."""
        loader = self.loader
        sampler = getattr(loader, "sampler", None)
        consumed = epoch_step * self.grad_accum
        positioned, self._positioned = self._positioned, False
        if isinstance(sampler, EpochSampler):
            sampler.set_epoch(epoch, start=consumed * (loader.batch_size or 1))  # type: ignore[attr-defined]  # a DataLoader: its sampler
        elif hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]  # hasattr checked above
        batches = _opened(loader, keep_rng=epoch_step > 0 and not rng_held)
        if isinstance(sampler, EpochSampler):
            return batches
        if self.check_rows:
            batches = check_batches(batches, "train")
        if consumed and not positioned:
            warnings.warn(
                f"hookloop resume: the train data ({type(loader).__name__}) cannot be positioned "
                f"mid-epoch, so {consumed} already-trained batches are read and dropped; the "
                "resume is exact only if the data comes in the same order every run. Pass a "
                "dataset (an object with __getitem__ and __len__: hookloop batches and shuffles it "
                "reproducibly) or a loader with "
                "state_dict()/load_state_dict() (e.g. torchdata's StatefulDataLoader).",
                stacklevel=3,
            )
            batches = itertools.islice(batches, consumed, None)
        return batches


def check_resize(
    saved: dict[str, Any], now: dict[str, Any], *, exact: bool, stateful: bool
) -> None:
    """A resume on another number of ranks: the global batch (ranks x per-rank batch x
    micro-batches) must stay the same, and the data must be dealt by hookloop's sampler
    (a loader with a state of its own is restored as saved, with a warning; anything
    else is refused). Raises ``ValueError`` with one line naming what would fit."""
    was, now_ranks = saved["world_size"], now["world_size"]
    if not exact:
        what = "its own state_dict()" if stateful else "no state (its batches are read again)"
        if not stateful:
            raise ConfigError(
                f"cannot resume with {now_ranks} ranks x {now['grad_accum']} micro-batches a "
                f"run saved with {was} x {saved.get('grad_accum')}: its train data is a loader "
                f"with {what}, whose position does not carry over; resume with the saved layout, "
                "or pass a dataset (hookloop deals it by a global order that does not depend on "
                "the number of ranks)"
            )
        warnings.warn(
            f"hookloop resume: saved with {was} ranks, resuming with {now_ranks}; the train "
            f"loader restores {what}, which hookloop cannot check is exact on another number "
            "of ranks",
            stacklevel=4,
        )
        return
    sizes = (saved.get("batch_size"), saved.get("grad_accum"))
    if None in sizes:
        return
    global_batch = was * sizes[0] * sizes[1]
    per_rank, accum = now["batch_size"], now["grad_accum"]
    if now_ranks * per_rank * accum == global_batch:
        return
    fits = [
        f"data.batch_size={global_batch // (now_ranks * k)} with train.grad_accum={k}"
        for k in range(1, global_batch + 1)
        if global_batch % (now_ranks * k) == 0
    ][:3]
    hint = "; ".join(fits) if fits else f"no split of {global_batch} over {now_ranks} ranks"
    raise ConfigError(
        f"resuming on {now_ranks} ranks a run saved on {was}: the global batch was "
        f"{global_batch} ({was} ranks x {sizes[0]} per rank x {sizes[1]} micro-batches), now "
        f"{now_ranks * per_rank * accum}; keep it with {hint}"
    )


def one_ahead(items: Iterator[Any]) -> Iterator[Any]:
    """``items`` with each next one fetched before the current one is handed out (what
    accelerate's loader does, so that it knows which batch is the last)."""
    try:
        ahead = next(items)
    except StopIteration:
        return
    for item in items:
        current, ahead = ahead, item
        yield current
    yield ahead


def release_at(items: Iterator[Any], k: int, release: Callable[[], None]) -> Iterator[Any]:
    """``items``, calling ``release()`` once the ``k``-th has been fetched, before it is
    handed out (transformers restores a resume's generators there: after the first step's
    batches, and the one its loader fetched ahead, were drawn)."""
    for index, item in enumerate(items, 1):
        if index == k:
            release()
        yield item


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
