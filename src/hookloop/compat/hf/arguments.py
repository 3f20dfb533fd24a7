"""Which of transformers' ``TrainingArguments`` the HF dialect honours, and the refusal
of the rest: no setting is accepted and then silently ignored.

A field of transformers' ``TrainingArguments`` is, here, one of:

- **honoured**: a field of :class:`hookloop.compat.hf.plain_args.PlainTrainingArguments` (the
  dialect reads it), or one of :data:`LOADER_FIELDS` (passed to the ``DataLoader``);
- **without effect** on what the dialect runs, for the reason :data:`NO_EFFECT` gives
  (transformers' Trainer does not read ``do_train`` either; hub settings matter only
  with ``push_to_hub``, which is refused; ...): accepted at any value;
- **refused** when set to anything but transformers' default, naming every such field
  and its default: whatever transformers would do with it, the dialect does not.

A field transformers adds in a later release falls in the last group until this
module says otherwise.

The rest of what the Trainer does with its arguments is here too: the Config that runs
them, the seed and log level they set, and the snapshot ``train()`` compares them with
to know whether the loop must be built again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hookloop.compat.hf.optim import arg

if TYPE_CHECKING:
    from hookloop.config import Config

#: Passed to the training and evaluation ``DataLoader`` (worker and memory mechanics).
LOADER_FIELDS = (
    "dataloader_pin_memory",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context",
)

#: Fields of transformers 4.x that 5.x dropped, still read when an object carries them.
TRANSFORMERS_4_FIELDS = ("logging_dir", "warmup_ratio")

#: transformers' fields that change nothing the dialect runs, with the reason.
NO_EFFECT: dict[str, str] = {
    "do_train": "read by example scripts, not by transformers' Trainer",
    "do_eval": "read by example scripts, not by transformers' Trainer",
    "do_predict": "read by example scripts, not by transformers' Trainer",
    "resume_from_checkpoint": "read by example scripts; train(resume_from_checkpoint=) resumes",
    "local_rank": "set by the launcher; the rank is torch.distributed's",
    "log_level_replica": "transformers' own logger's verbosity on other ranks",
    "log_on_each_node": "transformers' own logger on other nodes",
    "optim_target_modules": "read only by GaLore/APOLLO optimizers, which are refused",
    "average_tokens_across_devices": "one process: nothing to average across",
    "torch_empty_cache_steps": "frees cached device memory; the numbers stay the same",
    "eval_accumulation_steps": "moves predictions to the host sooner; the metrics stay the same",
    "eval_use_gather_object": "how predictions are gathered across ranks; every rank evaluates all",
    "save_on_each_node": "several nodes only",
    "dataloader_in_order": "accelerate's batch order across processes",
    "length_column_name": "read only with group_by_length",
    "project": "a trackio setting; report_to='trackio' is refused",
    "trackio_space_id": "a trackio setting; report_to='trackio' is refused",
    "trackio_bucket_id": "a trackio setting; report_to='trackio' is refused",
    "trackio_static_space_id": "a trackio setting; report_to='trackio' is refused",
    "hub_token": "read only with push_to_hub, which is refused",
    "hub_private_repo": "read only with push_to_hub, which is refused",
    "hub_model_id": "read only with push_to_hub, which is refused",
    "hub_strategy": "read only with push_to_hub, which is refused",
    "hub_always_push": "read only with push_to_hub, which is refused",
    "hub_revision": "read only with push_to_hub, which is refused",
    "ddp_find_unused_parameters": "DDP's tuning; the numbers stay the same",
    "ddp_bucket_cap_mb": "DDP's tuning; the numbers stay the same",
    "ddp_broadcast_buffers": "DDP's tuning; the numbers stay the same",
    "ddp_static_graph": "DDP's tuning; the numbers stay the same",
    "ddp_backend": "the process group is the launcher's (hookloop picks gloo or nccl)",
    "ddp_timeout": "the process group is the launcher's",
}


#: Values other than transformers' default that ask for what the dialect does anyway:
#: transformers sets ``torch_compile_backend="inductor"`` for ``torch_compile=True``, and
#: the loop's ``train.compile`` is ``torch.compile`` with that backend.
SAME_AS_DIALECT: dict[str, tuple[Any, ...]] = {"torch_compile_backend": ("inductor",)}


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


_OFF = ("", None, False, [], {})  # "not set": transformers' __post_init__ turns one into another


def _same(value: Any, default: Any) -> bool:
    value = getattr(value, "value", value)  # an enum reads as its value, as transformers'
    default = getattr(default, "value", default)
    if value is default or (value in _OFF and default in _OFF):
        return True
    if default is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        # transformers builds a config object with its defaults from None
        return not ignored_fields(value, set())
    return bool(value == default)


def _base_fields(args: Any) -> set[str] | None:
    """The fields of the ``TrainingArguments`` class ``args`` derives from (ours or
    transformers'); a user's subclass adds fields of its own, which are the user's."""
    for klass in reversed(type(args).__mro__):
        if klass.__name__ == "TrainingArguments" and dataclasses.is_dataclass(klass):
            return {f.name for f in dataclasses.fields(klass)}
    return None


def ignored_fields(args: Any, honoured: set[str]) -> dict[str, tuple[Any, Any]]:
    """``{field: (value, transformers' default)}`` for each field of a dataclass
    ``args`` set to what the dialect would not carry out (a subclass's own fields
    are not looked at)."""
    if not dataclasses.is_dataclass(args):
        return {}
    base = _base_fields(args)
    odd = {}
    for field in dataclasses.fields(args):
        name = field.name
        if base is not None and name not in base:
            continue
        if not field.init or name in honoured or name in LOADER_FIELDS or name in NO_EFFECT:
            continue
        default = _default(field)
        value = getattr(args, name, default)
        if value in SAME_AS_DIALECT.get(name, ()):
            continue
        if default is dataclasses.MISSING or not _same(value, default):
            odd[name] = (value, default)
    return odd


def honoured_fields(cls: type) -> set[str]:
    """The fields of a dialect ``TrainingArguments`` class that the dialect reads (its
    copies of transformers' other fields say otherwise in their help text)."""
    from hookloop.compat.hf.plain_args import NOT_CARRIED_OUT

    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("help") != NOT_CARRIED_OUT}


def refuse_ignored(args: Any, honoured: set[str]) -> None:
    """Refuse ``args`` when a field is set to what the dialect does not carry out."""
    odd = ignored_fields(args, honoured)
    if odd:
        raise ValueError(
            "hookloop.compat.hf.Trainer does not carry out "
            + ", ".join(f"{k}={v!r}" for k, (v, _) in odd.items())
            + "; leave them at transformers' defaults ("
            + ", ".join(f"{k}={d!r}" for k, (_, d) in odd.items())
            + ")"
        )


def args_config(args: Any) -> Config:
    """The Config that runs ``args``; an object of another class is read by name."""
    from hookloop.compat.hf.plain_args import PlainTrainingArguments, config_for

    if isinstance(args, PlainTrainingArguments) or _base_fields(args) is not None:
        return config_for(args)
    fields = {
        name: getattr(args, name)
        for name in PlainTrainingArguments.__dataclass_fields__
        if hasattr(args, name)
    }
    return PlainTrainingArguments(**fields).to_config()


def seed_everything(seed: int) -> None:
    """HF's ``set_seed``: Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
               "error": logging.ERROR, "critical": logging.CRITICAL}  # fmt: skip


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Python's, numpy's and torch's generators as they were before the block (which may
    seed them)."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def apply_log_level(args: Any) -> None:
    """``log_level``: the verbosity of transformers' loggers (and so of the dialect's
    messages on them); ``"passive"`` leaves it alone, as transformers does."""
    level = arg(args, "log_level", "passive") if args is not None else "passive"
    if level == "passive":
        return
    if level not in _LOG_LEVELS:
        raise ValueError(
            f"TrainingArguments.log_level must be one of passive, {', '.join(_LOG_LEVELS)}; "
            f"got {level!r}"
        )
    logging.getLogger("transformers").setLevel(_LOG_LEVELS[level])


def snapshot(args: Any) -> dict[str, Any] | None:
    """The arguments' fields as they are now (None: not a dataclass, nothing compared)."""
    if args is None or not dataclasses.is_dataclass(args):
        return None
    values = {}
    for field in dataclasses.fields(args):
        try:
            values[field.name] = copy.deepcopy(getattr(args, field.name))
        except Exception:
            continue
    return values


def changed_fields(before: dict[str, Any] | None, args: Any) -> list[str]:
    """The fields of ``args`` that differ from ``before``."""
    if before is None:
        return []
    changed = []
    for name, value in before.items():
        try:
            same = bool(getattr(args, name, value) == value)
        except Exception:
            same = True
        if not same:
            changed.append(name)
    return changed


def with_batch_size(built: dict[str, Any] | None, batch_size: int | None) -> Any:
    """A snapshot with another training batch size (``batch_size`` None: as it is)."""
    if built is None or batch_size is None:
        return built
    return {**built, "per_device_train_batch_size": batch_size}


@contextlib.contextmanager
def batch_size_as_built(args: Any, built: dict[str, Any] | None) -> Iterator[None]:
    """transformers fixes the training batch size when its Trainer is built (a later
    ``per_device_train_batch_size`` is not used by ``train()``): the loop is rebuilt
    with the one it was built with, and ``args`` keeps the user's value."""
    name = "per_device_train_batch_size"
    given = getattr(args, name, None)
    if built is None or built.get(name) is None or given is None:
        yield
        return
    setattr(args, name, built[name])
    try:
        yield
    finally:
        setattr(args, name, given)
