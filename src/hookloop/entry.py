"""Entry points in the Megatron style: a config container and a forward step.

``pretrain(config, forward_step)`` builds the model and data from the config's
recipe, seeds every RNG, and runs the same :class:`~hookloop.Trainer` you can
build by hand. ``finetune`` does the same from pretrained weights.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookloop.callback import Callback
from hookloop.checkpoint import load_weights
from hookloop.config import Config
from hookloop.loop import Trainer
from hookloop.manager import CallbackManager
from hookloop.recipes import get_recipe
from hookloop.result import TrainResult

__all__ = ["build_trainer", "finetune", "load_weights", "pretrain", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_trainer(
    config: Config,
    forward_step: Any = None,
    callbacks: CallbackManager | Iterable[Callback] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
    non_loss_data_func: Any = None,
) -> Trainer:
    """Seed, build the recipe's parts, and assemble a Trainer (without training).

    ``non_loss_data_func(model)`` runs at the end of each evaluation; its result is
    ``ctx.non_loss_data`` during ``on_eval_end`` (Megatron-Bridge's evaluation hook).
    """
    if not isinstance(config, Config):
        raise TypeError(f"config must be a hookloop Config, got {type(config).__name__}")
    config.validate()
    seed_everything(config.seed)
    parts = get_recipe(config.recipe).build(config)
    manager = callbacks if isinstance(callbacks, CallbackManager) else CallbackManager(callbacks)
    if parts.callbacks:
        manager.add(parts.callbacks)
    return Trainer(
        parts.model,
        parts.optimizer,
        scheduler=parts.scheduler,
        train_data=parts.train_data,
        eval_data=parts.eval_data,
        test_data=parts.test_data,
        config=config,
        callbacks=manager,
        forward_step=forward_step or parts.forward_step,
        loss_fn=None if (forward_step or parts.forward_step) else parts.loss_fn,
        out_dir=None if out_dir is None else str(out_dir),
        resume=resume,
        flops_per_sample=parts.flops_per_sample,
        non_loss_data_func=non_loss_data_func,
    )


def pretrain(
    config: Config,
    forward_step: Any = None,
    callbacks: CallbackManager | Iterable[Callback] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
    non_loss_data_func: Any = None,
) -> TrainResult:
    """Train the config's recipe from scratch; ``callbacks`` is a list or a manager."""
    return build_trainer(
        config,
        forward_step,
        callbacks,
        out_dir=out_dir,
        resume=resume,
        non_loss_data_func=non_loss_data_func,
    ).train()


def finetune(
    config: Config,
    forward_step: Any = None,
    callbacks: CallbackManager | Iterable[Callback] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
    non_loss_data_func: Any = None,
) -> TrainResult:
    """Like ``pretrain``, starting from the weights at ``config.checkpoint.pretrained``.

    Only the model weights are loaded (a fresh optimizer, schedule and data
    order); to continue an interrupted run use ``resume`` instead.
    """
    if not config.checkpoint.pretrained:
        raise ValueError(
            "finetune() needs config.checkpoint.pretrained: a checkpoint directory or a "
            ".safetensors file with the pretrained weights"
        )
    trainer = build_trainer(
        config,
        forward_step,
        callbacks,
        out_dir=out_dir,
        resume=resume,
        non_loss_data_func=non_loss_data_func,
    )
    if resume is None:
        load_weights(trainer.model, config.checkpoint.pretrained)
    return trainer.train()
