"""Test doubles for users testing their own callbacks: a tiny model, toy data,
a callback that records every event it sees, and a bitwise comparison of two
checkpoints (for tests of exact resume).

>>> from hookloop import Config, DataConfig, Trainer, TrainConfig
>>> rec = RecordingCallback()
>>> cfg = Config(train=TrainConfig(max_steps=2, log_every=0), data=DataConfig(batch_size=4))
>>> trainer = Trainer(TinyModel(), train_data=ToyData(n=16), loss_fn=TinyModel.loss_fn,
...                   config=cfg, callbacks=[rec])
>>> _ = trainer.train()
>>> [e for e, step, micro in rec.events][:3]
['on_init_end', 'on_data_init_start', 'on_train_start']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from hookloop.callback import Callback
from hookloop.events import EVENT_NAMES
from hookloop.safeload import load
from hookloop.state import CallbackContext


class TinyModel(torch.nn.Module):
    """Linear(4 → 8) → ReLU → Linear(8 → 1), deterministic for a given seed."""

    def __init__(self, inputs: int = 4, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(outputs, targets)


class ToyData(Dataset):
    """``n`` samples of ``(x, y)`` with ``y = sum(x) / 2``: learnable in a few steps."""

    def __init__(self, n: int = 64, inputs: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, inputs, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) / 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class RecordingCallback(Callback):
    """Records ``(event, step, micro_step)`` for every event (or only ``events``)."""

    priority = 0

    def __init__(self, events: list[str] | None = None) -> None:
        self.only = set(events) if events is not None else None
        self.events: list[tuple[str, int, int]] = []
        self.contexts: list[dict[str, Any]] = []

    def _record(self, event: str, ctx: CallbackContext) -> None:
        if self.only is None or event in self.only:
            self.events.append((event, ctx.state.step, ctx.state.micro_step))

    def names(self) -> list[str]:
        return [e for e, _, _ in self.events]


def _make_recorder(event: str) -> Any:
    def handler(self: RecordingCallback, ctx: CallbackContext) -> None:
        self._record(event, ctx)

    handler.__name__ = event
    return handler


for _event in EVENT_NAMES:
    setattr(RecordingCallback, _event, _make_recorder(_event))
del _event


def assert_same_checkpoint(a: str | Path, b: str | Path) -> None:
    """Assert that two single-process checkpoint directories hold bitwise-equal model
    weights (``model.safetensors``) and optimizer state (``optimizer.pt``): what a test of
    exact resume compares between a stopped-and-resumed run and an uninterrupted one."""
    from safetensors.torch import load_file

    a, b = Path(a), Path(b)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys(), f"weights differ in keys: {sorted(wa.keys() ^ wb.keys())}"
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"weight {key} differs"
    oa, ob = load(a / "optimizer.pt"), load(b / "optimizer.pt")
    for pid, state in oa["state"].items():
        for key, value in state.items():
            other = ob["state"][pid][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"optimizer state {pid}.{key} differs"
            else:
                assert value == other, f"optimizer state {pid}.{key} differs"
