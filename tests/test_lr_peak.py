"""Moving the peak of a running schedule: one function for a live ``set lr=`` and for an
``optimizer.lr`` override on resume (:func:`hookloop.optim.move_lr_peak`)."""

from __future__ import annotations

import pytest
import torch

from hookloop.optim import lr_peak, move_lr_peak


def _run(peak: float, steps: int, *, move_to: float | None = None, at: int = 0) -> list[float]:
    """The rates a warm-up-then-cosine schedule gives, its peak moved at step ``at``."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=peak)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    rates = []
    for step in range(steps):
        if move_to is not None and step == at:
            move_lr_peak(optimizer, warmup, 0, move_to)
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        warmup.step()
    return rates


def test_a_moved_peak_goes_on_as_a_schedule_built_with_it():
    moved = _run(1.0, 8, move_to=0.5, at=2)
    fresh = _run(0.5, 8)
    assert moved[:2] == [0.25, 0.5]  # before the move: the old peak's warm-up
    assert moved[2:] == pytest.approx(fresh[2:], rel=1e-12)  # after: the new peak's


def test_the_peak_is_the_schedules_base_rate_and_initial_lr_follows():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=3e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    before = optimizer.param_groups[0]["lr"]
    assert lr_peak(optimizer, scheduler, 0) == 3e-4 > before
    move_lr_peak(optimizer, scheduler, 0, 6e-4)
    assert scheduler.base_lrs == [6e-4]
    assert optimizer.param_groups[0]["initial_lr"] == 6e-4
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * before)


def test_without_a_schedule_the_peak_is_the_rate():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    move_lr_peak(optimizer, None, 0, 0.02)
    assert lr_peak(optimizer, None, 0) == optimizer.param_groups[0]["lr"] == 0.02
    assert "initial_lr" not in optimizer.param_groups[0]
