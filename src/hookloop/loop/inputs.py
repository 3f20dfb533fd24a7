"""What the Trainer was given, checked, as :func:`hookloop.loop.parts.build_parts` reads it.

Each check refuses a wrong value with one line naming what was given and what is
allowed; :class:`Inputs` holds the checked values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hookloop.config import Config, TrainConfig
from hookloop.manager import CallbackManager


@dataclass
class Inputs:
    """What the Trainer was given (checked)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], Any] | None
    data: tuple[Any, Any, Any]  # train, eval, test (each may be None)
    config: Config
    callbacks: CallbackManager
    forward_step: Any
    loss_fn: Any
    scheduler: Any
    out_dir: str | None
    resume: str | None
    non_loss_data_func: Any
    collate_fn: Callable[[list[Any]], Any] | None = None


def check_inputs(
    model: Any, optimizer: Any, forward_step: Any, loss_fn: Any, non_loss_data_func: Any
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not (
        isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)
    ):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a function of the model that makes "
            f"one, or None, got {type(optimizer).__name__}"
        )
    if forward_step is not None and loss_fn is not None:
        raise ValueError("give forward_step or loss_fn, not both (loss_fn is for the default step)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(outputs, targets), got {loss_fn!r}")
    if non_loss_data_func is not None and not callable(non_loss_data_func):
        raise TypeError(f"non_loss_data_func must be callable(model), got {non_loss_data_func!r}")


def check_flops(value: Any) -> float | None:
    """A FLOPs-per-sample figure must be a finite number > 0 (or None: no estimate)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e300:
        raise ValueError(
            f"flops_per_sample must be a finite number > 0 or None (no estimate), got {value!r}"
        )
    return float(value)


def as_config(config: Config | TrainConfig | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, TrainConfig):
        return Config(train=config)
    raise TypeError(
        f"config must be a hookloop Config or TrainConfig (or None), got {type(config).__name__}"
    )


def as_manager(callbacks: Any) -> CallbackManager:
    if callbacks is None:
        return CallbackManager()
    if isinstance(callbacks, CallbackManager):
        return callbacks
    return CallbackManager(callbacks)
