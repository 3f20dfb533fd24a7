"""The batches ``transformers.Trainer`` would build: same samples, same order, same collation.

- Any sized dataset with ``__getitem__`` is a map-style dataset (HF's test
  ``RegressionDataset``, a ``datasets.Dataset``), not only a torch ``Dataset``.
- The training order is HF's ``RandomSampler`` as accelerate seeds it: epoch
  ``e`` is ``randperm(n)`` from a generator seeded with ``data_seed`` (or
  ``seed``) ``+ e``. Evaluation is sequential. ``dataloader_drop_last`` applies
  to both, as in HF. The sampler is a :class:`hookloop.data.EpochSampler`, so a
  resume starts at the exact sample.
- The collator is the one given, else ``DataCollatorWithPadding`` when a
  tokenizer is the ``processing_class``, else :func:`default_data_collator`.
- ``remove_unused_columns`` drops what ``model.forward`` does not take: columns
  of a ``datasets.Dataset``, keys of each sample otherwise.
- The loader draws its worker seed from the global torch RNG on each pass, as
  HF's does, so dropout masks after a pass match HF's too.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from hookloop.compat.hf.optim import arg
from hookloop.data import EpochSampler
from hookloop.distributed import rank_info

SAMPLING = ("random", "sequential")


class HFSampler(EpochSampler):
    """HF's training order (or the sequential one), resumable mid-epoch. With
    several ranks each takes every ``world_size``-th sample of that order.

    ``follows_torch_seed``: without ``data_seed`` accelerate seeds the order with
    ``torch.initial_seed()`` as it is when ``train()`` prepares the loader (``seed``,
    unless a ``model_init`` or the user's code seeded torch since); the dialect's
    ``train()`` sets ``seed`` from it then.
    """

    follows_torch_seed = False

    def order(self) -> list[int]:
        if not self.shuffle:
            order = list(range(self.length))
        else:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        if self.world_size == 1:
            return order
        per_rank = self.length // self.world_size
        return order[self.rank : per_rank * self.world_size : self.world_size]


def is_map_dataset(data: Any) -> bool:
    """Sized and indexable, and not already a loader or a stream."""
    return (
        not isinstance(data, (DataLoader, IterableDataset))
        and hasattr(data, "__len__")
        and hasattr(data, "__getitem__")
    )


def default_data_collator(features: list[Any]) -> Any:
    """HF's ``default_data_collator``: dicts (or objects, by ``vars``) of
    tensors, arrays or numbers become one dict of stacked tensors; ``label`` /
    ``label_ids`` become ``labels``. Samples that are tuples are collated by
    torch's ``default_collate``."""
    first = features[0]
    if not isinstance(first, Mapping):
        if not hasattr(first, "__dict__"):
            return default_collate(features)
        features = [vars(f) for f in features]
        first = features[0]
    batch: dict[str, Any] = {}
    if first.get("label") is not None:
        label = (
            first["label"].item() if isinstance(first["label"], torch.Tensor) else first["label"]
        )
        dtype = torch.long if isinstance(label, (int, np.integer)) else torch.float
        batch["labels"] = torch.tensor([f["label"] for f in features], dtype=dtype)
    elif first.get("label_ids") is not None:
        if isinstance(first["label_ids"], torch.Tensor):
            batch["labels"] = torch.stack([f["label_ids"] for f in features])
        else:
            dtype = (
                torch.long if isinstance(first["label_ids"][0], (int, np.integer)) else torch.float
            )
            batch["labels"] = torch.tensor([f["label_ids"] for f in features], dtype=dtype)
    for key, value in first.items():
        if key in ("label", "label_ids") or value is None or isinstance(value, str):
            continue
        column = [f[key] for f in features]
        if isinstance(value, torch.Tensor):
            batch[key] = torch.stack(column)
        elif isinstance(value, np.ndarray):
            batch[key] = torch.from_numpy(np.stack(column))
        else:
            batch[key] = torch.tensor(column)
    return batch


def label_names(model: torch.nn.Module, args: Any) -> list[str]:
    """``args.label_names``, else the ``forward`` parameters whose name holds "label"."""
    names = arg(args, "label_names", None)
    if names is not None:
        return list(names)
    return [p for p in inspect.signature(model.forward).parameters if "label" in p]


def signature_columns(model: torch.nn.Module, args: Any) -> list[str]:
    """The sample keys HF keeps: ``forward``'s parameters and the label names."""
    columns = list(inspect.signature(model.forward).parameters)
    return columns + sorted({"label", "label_ids", *label_names(model, args)} - set(columns))


def _is_hf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("datasets.") and hasattr(data, "remove_columns")


class _RemoveColumns:
    """Drops the keys ``forward`` does not take from each sample, then collates."""

    def __init__(self, collator: Callable[[list[Any]], Any], keep: list[str]) -> None:
        self.collator, self.keep = collator, set(keep)

    def __call__(self, features: list[Any]) -> Any:
        if isinstance(features[0], Mapping):
            features = [{k: v for k, v in f.items() if k in self.keep} for f in features]
        return self.collator(features)


def collator_for(data_collator: Any, processing_class: Any) -> Callable[[list[Any]], Any]:
    """The collator HF uses: the given one, a padding one for a tokenizer, else the default."""
    if data_collator is not None:
        if not callable(data_collator):
            raise TypeError(
                "data_collator must be a function of a list of samples, "
                f"got {type(data_collator).__name__}"
            )
        return data_collator
    if processing_class is not None and hasattr(processing_class, "pad"):
        from transformers import DataCollatorWithPadding  # a tokenizer means transformers is here

        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def _without_unused_columns(
    data: Any, args: Any, model: torch.nn.Module, collator: Callable[[list[Any]], Any]
) -> tuple[Any, Callable[[list[Any]], Any], list[str]]:
    """``remove_unused_columns``: a ``datasets.Dataset`` without the columns ``forward``
    does not take (and their names), or a collator that drops such keys."""
    if not arg(args, "remove_unused_columns", True):
        return data, collator, []
    keep = signature_columns(model, args)
    if not _is_hf_dataset(data):
        return data, _RemoveColumns(collator, keep), []
    ignored = [c for c in data.column_names if c not in keep]
    if len(ignored) == len(data.column_names):
        raise ValueError(
            f"no column of the dataset ({', '.join(data.column_names)}) is an argument of "
            f"{type(model).__name__}.forward ({', '.join(keep)}); set "
            "remove_unused_columns=False or rename the columns"
        )
    return data.remove_columns(ignored), collator, ignored


def make_loader(
    data: Any,
    *,
    args: Any,
    model: torch.nn.Module,
    collator: Callable[[list[Any]], Any],
    train: bool,
) -> DataLoader:
    """The DataLoader ``transformers.Trainer`` builds for ``data``."""
    data, collator, ignored = _without_unused_columns(data, args, model, collator)
    batch_size = arg(
        args, "per_device_train_batch_size" if train else "per_device_eval_batch_size", 8
    )
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "collate_fn": collator,
        "num_workers": arg(args, "dataloader_num_workers", 0),
        # pinned host memory speeds copies to a GPU; on a CPU-only run torch would warn
        "pin_memory": bool(arg(args, "dataloader_pin_memory", True)) and torch.cuda.is_available(),
    }
    if common["num_workers"] > 0:  # torch refuses these without workers, as HF leaves them
        common["persistent_workers"] = bool(arg(args, "dataloader_persistent_workers", False))
        common["prefetch_factor"] = arg(args, "dataloader_prefetch_factor", None)
        common["multiprocessing_context"] = arg(args, "dataloader_multiprocessing_context", None)
    if isinstance(data, IterableDataset):
        return _remember(_with_total(DataLoader(data, **common), batch_size), ignored)
    sampling = str(arg(args, "train_sampling_strategy", "random")) if train else "sequential"
    if sampling not in SAMPLING:
        raise ValueError(
            f"TrainingArguments.train_sampling_strategy={sampling!r} is not supported by "
            f"hookloop.compat.hf; allowed: {', '.join(SAMPLING)}"
        )
    data_seed = arg(args, "data_seed", None)
    # Training data is shared out between ranks; every rank evaluates all of it (the
    # metrics are then the same everywhere without gathering predictions).
    rank, _, world_size = rank_info() if train else (0, 0, 1)
    sampler = HFSampler(
        len(data),
        shuffle=sampling == "random",
        seed=data_seed if data_seed is not None else arg(args, "seed", 42),
        rank=rank,
        world_size=world_size,
    )
    sampler.follows_torch_seed = data_seed is None
    loader = DataLoader(
        data, sampler=sampler, drop_last=bool(arg(args, "dataloader_drop_last", False)), **common
    )
    return _remember(_with_total(loader, batch_size), ignored)


#: The columns each loader's dataset lost to ``remove_unused_columns`` (what transformers
#: names each time it builds a loader: :func:`hookloop.compat.hf.console.announce_ignored`).
_IGNORED: weakref.WeakKeyDictionary[DataLoader, list[str]] = weakref.WeakKeyDictionary()


def _remember(loader: DataLoader, ignored: list[str]) -> DataLoader:
    if ignored:
        _IGNORED[loader] = ignored
    return loader


def ignored_columns(loader: Any) -> list[str]:
    """The dataset columns :func:`make_loader` removed for ``loader`` (none: ``[]``)."""
    try:
        return _IGNORED.get(loader, [])
    except TypeError:  # not weakly referable: no loader of ours
        return []


def _with_total(loader: DataLoader, batch_size: int) -> DataLoader:
    """``total_batch_size``: the samples of one batch over every rank, as accelerate's
    prepared loaders say it."""
    loader.total_batch_size = batch_size * rank_info()[2]
    return loader


class Loaders:
    """One Trainer's loaders. ``spec`` is :func:`make_loader`'s ``args``, ``model`` and
    ``collator`` when ``TrainingArguments`` decide the run (None: every dataset passes
    through as it is); ``eval_sets`` holds the loader of each named evaluation dataset,
    ``kept`` the evaluation loaders ``dataloader_persistent_workers`` keeps, by name."""

    def __init__(self) -> None:
        self.spec: dict[str, Any] | None = None
        self.eval_sets: dict[str, Any] = {}
        self.kept: dict[str, Any] = {}
        #: The Trainer's ``data_collator`` as it is now (transformers reads the attribute
        #: each time it builds a loader); None: ``spec``'s.
        self.collator_of: Callable[[], Any] | None = None
        #: The evaluation dataset and collator the loop's evaluation loader was built from.
        self.built_from: tuple[Any, Any] = (None, None)

    def load(self, data: Any, *, train: bool) -> Any:
        """HF's DataLoader for a dataset when ``args`` decide the run; loaders, other data
        and None pass through."""
        hf_dataset = is_map_dataset(data) or isinstance(data, IterableDataset)
        if self.spec is None or data is None or not hf_dataset:
            return data
        return make_loader(data, train=train, **{**self.spec, "collator": self.collator()})

    def collator(self) -> Any:
        """The collator a loader built now takes."""
        if self.collator_of is not None:
            return self.collator_of()
        return self.spec["collator"] if self.spec is not None else None

    def built_for(self, dataset: Any) -> bool:
        """Whether the loop's evaluation loader is ``dataset``'s with today's collator."""
        made_of, collated_by = self.built_from
        return made_of is dataset and collated_by is self.collator()

    def evaluation(self, eval_dataset: Any, *, default: Any, built: Any, persistent: bool) -> Any:
        """The evaluation loader of ``eval_dataset``: a dataset, the name of one of the
        ``default`` dict's, or None for ``default`` itself (``built``, the loop's loader,
        when there is one and no named sets). With ``persistent`` a loader is built once
        per name and reused, as transformers keeps it."""
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        if isinstance(eval_dataset, str):
            sets = default if isinstance(default, Mapping) else {}
            if eval_dataset not in sets:
                raise ValueError(
                    f"get_eval_dataloader({eval_dataset!r}): the evaluation datasets are "
                    f"{', '.join(map(repr, sets)) or 'not a dict of named datasets'}"
                )
            data: Any = sets[eval_dataset]
        elif eval_dataset is not None:
            data = eval_dataset
        else:
            if built is not None and not self.eval_sets and self.built_for(default):
                return built
            if default is None:
                raise ValueError("Trainer: evaluation requires an eval_dataset")
            if isinstance(default, Mapping):
                raise ValueError(
                    "the evaluation datasets are a dict: name one of "
                    f"{', '.join(map(repr, default))}"
                )
            data = default
        if persistent and key in self.kept:
            return self.kept[key]
        loader = self.load(data, train=False)
        if persistent:
            self.kept[key] = loader
        return loader
