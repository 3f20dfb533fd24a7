"""A tiny regression task that trains in seconds: for tests, benchmarks and demos.

The targets are a fixed random linear function of the inputs plus noise, so
the loss has a known floor (the noise variance) and falls visibly in a few
hundred steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

from hookloop.config import Config, DataConfig, ModelConfig, opt
from hookloop.errors import ConfigError
from hookloop.recipes import Recipe, RecipeParts, register_recipe


@dataclass
class MLPConfig(ModelConfig):
    inputs: int = opt(32, "Input features.")
    hidden: int = opt(64, "Hidden units.")
    outputs: int = opt(1, "Output features.")
    dropout: float = opt(0.0, "Dropout after the hidden layer.")

    def validate(self) -> None:
        for name in ("inputs", "hidden", "outputs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout must lie in [0, 1), got {self.dropout!r}")


@dataclass
class RegressionDataConfig(DataConfig):
    train_samples: int = opt(4096, "Synthetic training samples.")
    eval_samples: int = opt(512, "Synthetic evaluation samples.")
    noise: float = opt(0.1, "Standard deviation of the target noise.")

    def validate(self) -> None:
        super().validate()
        for name in ("train_samples", "eval_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"data.{name} must be an int >= 1, got {value!r}")
        if self.noise < 0:
            raise ConfigError(f"data.noise must be >= 0, got {self.noise!r}")


def make_mlp(cfg: MLPConfig) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(cfg.inputs, cfg.hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(cfg.dropout),
        torch.nn.Linear(cfg.hidden, cfg.outputs),
    )


def make_regression_data(
    n: int, inputs: int, outputs: int, noise: float, seed: int
) -> TensorDataset:
    """``y = x @ W + noise`` with ``W`` fixed by ``seed`` (same task for train and eval)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(inputs, outputs, generator=g) / inputs**0.5
    x = torch.randn(n, inputs, generator=g)
    y = x @ weight + noise * torch.randn(n, outputs, generator=g)
    return TensorDataset(x, y)


def build(config: Config) -> RecipeParts:
    m, d = config.model, config.data
    assert isinstance(m, MLPConfig) and isinstance(d, RegressionDataConfig)
    full = make_regression_data(
        d.train_samples + d.eval_samples, m.inputs, m.outputs, d.noise, seed=1234
    )
    n = d.train_samples
    model = make_mlp(m)
    return RecipeParts(
        model=model,
        train_data=TensorDataset(*(t[:n] for t in full.tensors)),
        eval_data=TensorDataset(*(t[n:] for t in full.tensors)),
        loss_fn=torch.nn.functional.mse_loss,
        flops_per_sample=6.0 * sum(p.numel() for p in model.parameters()),
    )


def default_config() -> Config:
    cfg = Config(model=MLPConfig(), data=RegressionDataConfig(batch_size=32))
    cfg.optimizer.name = "sgd"
    cfg.optimizer.lr = 0.05
    cfg.optimizer.momentum = 0.9
    cfg.train.max_steps = 300
    cfg.train.log_every = 20
    cfg.train.eval_every = 100
    cfg.train.clip_grad_norm = None
    return cfg


register_recipe(
    Recipe(
        name="mlp-regression",
        description="Tiny MLP on a synthetic linear regression task (seconds; for tests).",
        default_config=default_config,
        build=build,
    )
)
