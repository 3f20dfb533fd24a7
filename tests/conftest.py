"""Shared fixtures: small configs and trainers over hookloop's own test doubles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hookloop import Config, Trainer
from hookloop.testing import TinyModel, ToyData


def _config(**train: Any) -> Config:
    """A Config for fast CPU runs: batch 4, no signal handlers, no logging unless asked."""
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.handle_signals = False
    cfg.train.log_every = 0
    for key, value in train.items():
        if not hasattr(cfg.train, key):
            raise AttributeError(f"TrainConfig has no field {key!r}")
        setattr(cfg.train, key, value)
    return cfg


@pytest.fixture
def make_config() -> Callable[..., Config]:
    """``make_config(max_steps=3, ...)``: TrainConfig fields as keywords."""
    return _config


@pytest.fixture
def make_trainer() -> Callable[..., Trainer]:
    """``make_trainer(callbacks=..., n=16, eval_n=None, **train_fields)``.

    TinyModel on ToyData(n) with mean-squared error; ``eval_n`` adds evaluation
    data of that many samples, ``cfg`` replaces the generated config.
    """

    def build(
        callbacks: Any = None,
        *,
        n: int = 16,
        eval_n: int | None = None,
        test_n: int | None = None,
        cfg: Config | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **train: Any,
    ) -> Trainer:
        return Trainer(
            model if model is not None else TinyModel(),
            optimizer,
            train_data=ToyData(n=n),
            eval_data=ToyData(n=eval_n, seed=1) if eval_n else None,
            test_data=ToyData(n=test_n, seed=2) if test_n else None,
            config=cfg if cfg is not None else _config(**train),
            callbacks=callbacks,
            loss_fn=TinyModel.loss_fn,
        )

    return build
