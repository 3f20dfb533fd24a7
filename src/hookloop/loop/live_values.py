"""The values a live ``set`` (and a run's start) may give each setting, and why.

Each check takes ``(key, value)`` and returns the value normalised, or raises
:class:`SettingError`: one line naming the key, the value and what is allowed.

The optimizer's numbers have an upper bound as well as a lower one. A step multiplies an
update by the learning rate (and the weights by ``lr * weight_decay``); a rate of ``1e39``
is not even a float32, so the first step after it overflows and every resume that replays
it dies again. :data:`MAX_RATE` bounds ``lr``, ``weight_decay`` and ``eps`` (and the rate an
``lr_scale`` would give); a value must also be finite in the parameters' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: The largest ``lr``, ``weight_decay`` and ``eps`` a run takes: far above any useful
#: value (rates are below 10), far below what a float16 weight can hold (65504).
MAX_RATE = 1e3


class SettingError(ValueError):
    """A ``set`` that cannot be applied; the message is one line naming the key."""


@dataclass(frozen=True)
class SettingChange:
    """One key changed by a ``set`` (``ctx.changes`` during ``on_settings_change``)."""

    step: int
    key: str
    old: Any
    new: Any
    client: str
    time: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Setting:
    """One settable value: how to read it, check a new one, and write it."""

    doc: str
    get: Callable[[], Any]
    put: Callable[[Any], None]
    check: Callable[[str, Any], Any]
    in_optimizer: bool = False  # restored with the optimizer / scheduler state


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SettingError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def positive(key: str, value: Any) -> float:
    number = _number(key, value)
    if number <= 0:
        raise SettingError(f"{key} must be a finite number > 0, got {value!r}")
    return number


def non_negative(key: str, value: Any) -> float:
    number = _number(key, value)
    if number < 0:
        raise SettingError(f"{key} must be a finite number >= 0, got {value!r}")
    return number


def rate(key: str, value: Any) -> float:
    """``lr`` and ``eps``: in ``(0, MAX_RATE]``."""
    return at_most(key, positive(key, value), "(0, 1000]")


def decay(key: str, value: Any) -> float:
    """``weight_decay``: in ``[0, MAX_RATE]``."""
    return at_most(key, non_negative(key, value), "[0, 1000]")


def at_most(key: str, number: float, allowed: str, dtype: torch.dtype | None = None) -> float:
    """``number`` if it is at most :data:`MAX_RATE` (and finite in ``dtype``), else a
    :class:`SettingError` naming the key, the value and the ``allowed`` range."""
    top = MAX_RATE if dtype is None else min(MAX_RATE, torch.finfo(dtype).max)
    if number > top:
        why = "" if top == MAX_RATE else f" (finite in the parameters' {dtype})"
        raise SettingError(f"{key}={number:g} is out of range: allowed {allowed}{why}")
    return number


def fraction(key: str, value: Any) -> float:
    number = _number(key, value)
    if not 0 <= number < 1:
        raise SettingError(f"{key} must be a number in [0, 1), got {value!r}")
    return number


def betas(key: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise SettingError(f"{key} must be a list of two numbers in [0, 1), got {value!r}")
    return (fraction(key, value[0]), fraction(key, value[1]))


def positive_or_off(key: str, value: Any) -> float | None:
    return None if value is None else positive(key, value)


def interval(key: str, value: Any, *, off: int | None) -> int | None:
    """A step interval: an int >= 1, or ``off`` (0 or null) to turn it off."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return off
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        shown = "0" if off == 0 else "null"
        raise SettingError(f"{key} must be an int >= 1 ({shown}: off), got {value!r}")
    return value


def same_type(key: str, old: Any, value: Any) -> Any:
    """A callback's settable: the new value has the old one's type (an int for a float)."""
    if old is None or (type(value) is type(old) and not isinstance(value, (list, dict))):
        return value
    if isinstance(old, float) and type(value) is int:
        return float(value)
    raise SettingError(
        f"{key} must be a {type(old).__name__} like its value {old!r}, got {value!r}"
    )


def same_type_as_attribute(owner: object, attr: str, key: str, value: Any) -> Any:
    """:func:`same_type` against ``owner.attr`` as it is now."""
    return same_type(key, getattr(owner, attr), value)


def plain(value: Any) -> Any:
    """A value as JSON writes it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


#: How each optimizer hyperparameter ``set`` may change is checked.
OPTIMIZER_CHECKS = {
    "lr": rate,
    "weight_decay": decay,
    "momentum": fraction,
    "betas": betas,
    "eps": rate,
}
#: The range each key takes, as docs/control.md shows it.
ALLOWED = {"lr": "(0, 1000]", "weight_decay": "[0, 1000]", "eps": "(0, 1000]"}


def check_recorded(record: dict[str, Any], changes: Any) -> None:
    """Each value of a record to replay within its key's range, checked before any step is
    trained (a one-line ConfigError naming the record in ``changes`` and ``--skip-change``)."""
    from hookloop.errors import ConfigError
    from hookloop.loop.changes import describe

    for key, value in record["values"].items():
        check = OPTIMIZER_CHECKS.get(key.split("@")[0])
        try:
            positive(key, value) if key == "lr_scale" else check and check(key, value)
        except SettingError as err:
            raise ConfigError(
                f"{changes}: change {describe(record)} cannot be applied: "
                f"{err}; to go on without it, add --skip-change {record['id']}"
            ) from None


def check_groups(groups: list[dict[str, Any]], peaks: list[float]) -> None:
    """Every parameter group's ``lr`` (its schedule's peak, ``peaks``), ``weight_decay``
    and ``eps`` at most :data:`MAX_RATE` and finite in its parameters' dtype
    (:class:`SettingError` naming the first that is not). The lower bounds are the
    config's and the optimizer's own business at the start."""
    for index, group in enumerate(groups):
        dtype = next((p.dtype for p in group["params"] if p.is_floating_point()), None)
        for key, allowed in ALLOWED.items():
            value = peaks[index] if key == "lr" else group.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # absent, or a tensor rate: the optimizer's own business
            same = all((peaks[i] if key == "lr" else g.get(key)) == value
                       for i, g in enumerate(groups))  # fmt: skip
            name = key if same else f"{key}@{index}"
            if math.isnan(value):
                raise SettingError(f"{name}={value!r} is out of range: allowed {allowed}")
            at_most(name, float(value), allowed, dtype)


def fixed_keys(config: Any) -> set[str]:
    """Config keys of any section: ``set`` refuses these as fixed for the run's life."""
    keys: set[str] = set()
    for section in vars(config).values():
        names = getattr(section, "__dataclass_fields__", None)
        if names:
            keys.update(names)
    keys.update(("batch_size", "seed", "model", "grad_accum", "max_steps", "max_epochs"))
    return keys
