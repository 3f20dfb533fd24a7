"""Optimizer and learning-rate schedule built from config (used by entry points).

``optimizer.name`` is one of the short names (``adamw``, ``adam``, ``sgd``, whose
settings are the section's keys), a ``torch.optim`` class name (``RMSprop``) or an
import path (``mypkg.optim:Lion``); the class is called with the parameter groups,
``lr``, ``weight_decay`` (when it takes one) and ``optimizer.kwargs``.
``scheduler.name`` is ``constant`` / ``cosine`` / ``linear`` (with warm-up), a
``torch.optim.lr_scheduler`` class name (``StepLR``) or an import path, called with
the optimizer and ``scheduler.kwargs``.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any

import torch

from hookloop.config import SCHEDULES, OptimizerConfig, SchedulerConfig
from hookloop.errors import ConfigError


def build_optimizer(cfg: OptimizerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer over the trainable parameters; no decay on biases and
    norms."""
    cfg.validate()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (requires_grad=True)")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name in ("adamw", "adam"):
        adam = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        settings = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
        return _construct(adam, groups, {**settings, **cfg.kwargs}, "optimizer")
    if cfg.name == "sgd":
        settings = {"lr": cfg.lr, "momentum": cfg.momentum}
        return _construct(torch.optim.SGD, groups, {**settings, **cfg.kwargs}, "optimizer")
    cls = resolve_class(cfg.name, torch.optim, "optimizer", torch.optim.Optimizer)
    if "weight_decay" not in inspect.signature(cls).parameters:
        if cfg.weight_decay:
            raise ConfigError(
                f"optimizer {cfg.name} takes no weight_decay: set optimizer.weight_decay=0"
            )
        groups = [{"params": params}]
    return _construct(cls, groups, {"lr": cfg.lr, **cfg.kwargs}, "optimizer")


def build_scheduler(
    cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int | None
) -> Any:
    """The configured schedule: a scheduler class's instance, or a LambdaLR with linear
    warm-up then constant / cosine / linear decay.

    Returns None for a constant rate without warm-up (nothing to step).
    """
    cfg.validate()
    if cfg.name not in SCHEDULES:
        cls = resolve_class(cfg.name, torch.optim.lr_scheduler, "scheduler", object)
        return _construct(cls, optimizer, dict(cfg.kwargs), "scheduler")
    if cfg.name == "constant" and cfg.warmup_steps == 0:
        return None
    if cfg.name != "constant" and not total_steps:
        raise ConfigError(
            f"scheduler.name={cfg.name!r} decays over the run, so it needs train.max_steps "
            "(or a sized dataset with train.max_epochs)"
        )
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    total = total_steps or 1

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if cfg.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resolve_class(name: str, module: Any, key: str, base: type) -> type:
    """The class ``name`` names: an attribute of ``module`` or ``package.module:Class``
    (imported); a one-line ``ConfigError`` naming ``key`` when it is not there."""
    if ":" not in name:
        found = getattr(module, name, None)
        if not isinstance(found, type):
            raise ConfigError(f"{key}.name={name!r}: {module.__name__} has no class {name!r}")
        return found
    module_name, _, attr = name.partition(":")
    try:
        found = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{key}.name={name!r}: cannot import {module_name!r} ({err})") from None
    for part in attr.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type) or not issubclass(found, base):
        what = f"a {base.__module__}.{base.__name__} class" if base is not object else "a class"
        raise ConfigError(f"{key}.name={name!r} does not name {what} (got {found!r})")
    return found


def _construct(cls: type, first: Any, kwargs: dict[str, Any], key: str) -> Any:
    """``cls(first, **kwargs)``; arguments it refuses become a one-line error naming
    ``key.kwargs``."""
    try:
        inspect.signature(cls).bind(first, **kwargs)
    except TypeError as err:
        raise ConfigError(
            f"{key} {cls.__name__} refuses its arguments ({err}); set {key}.kwargs to what "
            f"{cls.__name__}() takes"
        ) from None
    try:
        return cls(first, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{key} {cls.__name__}({', '.join(kwargs)}): {err}") from None


def lr_peak(optimizer: torch.optim.Optimizer, scheduler: Any, index: int) -> float:
    """The learning rate's peak in param group ``index``: the schedule's base rate
    (``base_lrs``) when it has one, else the group's current rate."""
    base = getattr(scheduler, "base_lrs", None)
    if base is not None and index < len(base):
        return float(base[index])
    return float(optimizer.param_groups[index]["lr"])


def move_lr_peak(optimizer: torch.optim.Optimizer, scheduler: Any, index: int, peak: float) -> None:
    """Move the peak of a running schedule in param group ``index`` to ``peak``.

    The one way hookloop moves it, for a live ``set lr=`` and for an ``optimizer.lr``
    override on resume: the current rate is scaled by the same factor as the peak, so a
    warm-up or a decay goes on from where it is, and the schedule's base rate and the
    group's ``initial_lr`` (what a scheduler rebuilt on resume starts from) follow.
    """
    group, base = optimizer.param_groups[index], getattr(scheduler, "base_lrs", None)
    old = lr_peak(optimizer, scheduler, index)
    group["lr"] = group["lr"] * (peak / old) if old else peak
    if "initial_lr" in group:
        group["initial_lr"] = peak
    if base is not None and index < len(base):
        base[index] = peak
