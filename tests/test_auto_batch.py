"""``data.batch_size=auto``: the largest batch that fits, with an injected out-of-memory."""

from __future__ import annotations

import pytest
import torch

from hookloop import Config, DataConfig, TrainConfig, Trainer
from hookloop.errors import ConfigError
from hookloop.testing import TinyModel, ToyData


class FitsUpTo(TinyModel):
    """Runs out of memory on batches of more than ``limit`` rows (as a GPU would)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried {x.shape[0]} rows")
        return super().forward(x)


def run(batch_size, limit: int = 1000, **data):
    torch.manual_seed(0)
    cfg = Config(train=TrainConfig(max_steps=4, log_every=0),
                 data=DataConfig(batch_size=batch_size, **data))  # fmt: skip
    trainer = Trainer(FitsUpTo(limit), train_data=ToyData(n=256), loss_fn=TinyModel.loss_fn,
                      config=cfg)  # fmt: skip
    trainer.train()
    return cfg, [p.detach().clone() for p in trainer.model.parameters()]


def test_auto_picks_the_largest_halving_that_fits_and_trains_as_that_size_given():
    cfg, weights = run("auto", limit=40, auto_batch_start=128)  # tries 128, 64, 32
    assert cfg.data.batch_size == 32
    _, given = run(32, limit=40)
    assert all(torch.equal(a, b) for a, b in zip(weights, given, strict=True))


def test_auto_starts_no_larger_than_the_data():
    cfg, _ = run("auto")  # 256 rows, first try min(1024, 256)
    assert cfg.data.batch_size == 256


def test_auto_with_nothing_that_fits_is_one_line():
    with pytest.raises(ConfigError, match="even a batch of 1 ran out of memory"):
        run("auto", limit=0, auto_batch_start=4)


def test_auto_needs_a_dataset_hookloop_batches():
    cfg = Config(train=TrainConfig(max_steps=1), data=DataConfig(batch_size="auto"))
    batches = [(torch.zeros(4, 4), torch.zeros(4, 1))] * 3
    with pytest.raises(ConfigError, match="batch_size=auto needs a training dataset"):
        Trainer(TinyModel(), train_data=batches, loss_fn=TinyModel.loss_fn, config=cfg)


def test_an_error_that_is_not_out_of_memory_is_the_users_own():
    class Broken(TinyModel):
        def forward(self, x):
            raise KeyError("my bug")

    cfg = Config(train=TrainConfig(max_steps=1), data=DataConfig(batch_size="auto"))
    with pytest.raises(KeyError, match="my bug"):
        Trainer(Broken(), train_data=ToyData(n=16), loss_fn=TinyModel.loss_fn, config=cfg)
