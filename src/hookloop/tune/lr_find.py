"""The learning-rate range test: train briefly while the rate grows, read the best one off.

The sweep raises the learning rate exponentially, one step at a time, from ``min_lr`` to
``max_lr`` over at most ``steps`` optimizer steps of hookloop's own loop (so the run's
forward step, precision, accumulation and clipping all apply). It stops early once the
smoothed loss is above ``diverge`` times the best one so far (or not finite).

The smoothed loss is an exponential moving average with bias correction (as fastai's
recorder): ``avg = beta * avg + (1 - beta) * loss``, shown as ``avg / (1 - beta ** k)``
after ``k`` steps. ``beta`` is 0.9 by default: fastai's 0.98 averages over ~50 steps,
half of a 100-step sweep, and drags the curve (and the suggestion) far behind the rates.

**The suggestion** is the steepest descent of the smoothed curve as plotted, log loss
against log rate: the rate at which the loss falls fastest *relative to itself*, each slope taken
over a tenth of the sweep (so that one noisy step does not count as a descent). It is
searched from a tenth of the way in (the first points are noise) up to the lowest
smoothed loss (past it the loss only rises). Why relative: on a quadratic of curvature
``L``, one SGD step at rate ``lr`` multiplies the loss by ``(1 - lr * L) ** 2``, smallest
at SGD's best rate ``1 / L``, whatever the loss was; an absolute slope instead peaks
where the loss is still large, early in the sweep (we measured 0.1-0.2 / L).

The sweep trains the Trainer its factory builds, and puts the weights and optimizer
state it started with back afterwards, bit for bit: a factory that wraps the user's own
model and optimizer leaves them as they were.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.state import CallbackContext


@dataclass
class LRFindResult:
    """The sweep: the rate of each step, its loss, the smoothed loss, the suggestion."""

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float | None  # None: too few steps to suggest anything
    stop_reason: str  # "finished" or "diverged"

    def plot(self, path: str | Path) -> Path:
        """Draw the smoothed loss against the rate (log scale), the suggestion marked; a PNG."""
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(self.lrs, self.smoothed, label="smoothed loss")
        if self.suggestion is not None:
            ax.axvline(self.suggestion, color="red", linestyle="--",
                       label=f"suggestion {self.suggestion:.3g}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")  # the suggestion is the steepest point of this very curve
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        ax.legend()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
        plt.close(fig)
        return path


def sweep_rates(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """``steps`` rates from ``min_lr`` to ``max_lr``, evenly spaced on a log scale.

    >>> sweep_rates(1e-3, 1e-1, 3)
    [0.001, 0.01, 0.1]
    """
    ratio = max_lr / min_lr
    return [min_lr * ratio ** (i / (steps - 1)) for i in range(steps)]


def smooth(losses: Sequence[float], beta: float) -> list[float]:
    """Exponential moving average of ``losses`` with bias correction.

    >>> smooth([4.0, 4.0, 4.0], 0.9)
    [4.0, 4.0, 4.0]
    """
    avg, out = 0.0, []
    for k, loss in enumerate(losses, start=1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta**k))
    return out


def steepest_descent(lrs: Sequence[float], smoothed: Sequence[float]) -> float | None:
    """The rate where ``log(smoothed)`` falls fastest against ``log(lr)``, before its minimum.

    Each slope spans a tenth of the sweep (at least one step), so a one-step blip of
    noise in a flat stretch does not pass for a descent; the rate returned is the
    middle of the steepest span.

    >>> steepest_descent([1, 10, 100, 1000, 10000], [5.0, 4.9, 1.0, 0.9, 9.0])
    10
    """
    end = min(range(len(smoothed)), key=smoothed.__getitem__)  # the lowest smoothed loss
    start = len(smoothed) // 10
    span = max(1, len(smoothed) // 10)
    if end - start < span + 1:
        return None
    if not all(value > 0 for value in smoothed[start : end + 1]):
        return None  # a loss at or below zero has no log: no relative slope to read
    x = [math.log(lr) for lr in lrs]
    y = [math.log(value) for value in smoothed]
    slopes = [(y[i + span] - y[i]) / (x[i + span] - x[i]) for i in range(start, end - span + 1)]
    steepest = start + min(range(len(slopes)), key=slopes.__getitem__)
    return lrs[steepest + span // 2]


class RateSweep(Callback):
    """Sets each step's rate before it runs, records its loss, stops at the end or on a
    divergence."""

    priority = 5

    def __init__(self, lrs: list[float], beta: float, diverge: float) -> None:
        self.lrs, self.beta, self.diverge = lrs, beta, diverge
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.stop_reason = "finished"
        self._avg = 0.0

    def on_train_step_start(self, ctx: CallbackContext) -> None:
        lr = self.lrs[min(len(self.losses), len(self.lrs) - 1)]
        assert ctx.optimizer is not None  # a training step has one
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        loss = float(ctx.loss_dict["loss"]) if ctx.loss_dict else math.nan  # one read a step
        self.losses.append(loss)
        self._avg = self.beta * self._avg + (1 - self.beta) * loss
        self.smoothed.append(self._avg / (1 - self.beta ** len(self.losses)))
        if not math.isfinite(self.smoothed[-1]) or self.smoothed[-1] > self.diverge * min(
            self.smoothed
        ):
            self.stop_reason = "diverged"
            ctx.control.request_abort()  # no save: a sweep leaves nothing behind
        elif len(self.losses) >= len(self.lrs):
            ctx.control.request_abort()


def lr_find(
    trainer_factory: Callable[[], Any],
    *,
    min_lr: float = 1e-7,
    max_lr: float = 1.0,
    steps: int = 100,
    beta: float = 0.9,
    diverge: float = 4.0,
    plot: str | Path | None = None,
) -> LRFindResult:
    """Run the range test on the Trainer ``trainer_factory()`` builds; see the module doc.

    ``plot``: a path to write the curve to (PNG). Refuses more than 500 steps: a range
    test is a few hundred steps at most.
    """
    _check_arguments(trainer_factory, min_lr, max_lr, steps, beta, diverge)
    trainer = trainer_factory()
    sweep = RateSweep(sweep_rates(min_lr, max_lr, steps), beta, diverge)
    model, optimizer = trainer.model, trainer.optimizer
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    scheduler = trainer.scheduler
    saved_scheduler = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
    trainer.callbacks.add(sweep)
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random stream goes on untouched
            trainer.train()
    finally:
        trainer.callbacks.remove(sweep)
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(saved_optimizer)
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        if scheduler is not None:
            scheduler.load_state_dict(saved_scheduler)
    lrs = sweep.lrs[: len(sweep.losses)]
    cut = len(lrs) - 1 if sweep.stop_reason == "diverged" else len(lrs)  # not the blow-up
    result = LRFindResult(
        lrs=lrs,
        losses=sweep.losses,
        smoothed=sweep.smoothed,
        suggestion=steepest_descent(lrs[:cut], sweep.smoothed[:cut]) if cut > 0 else None,
        stop_reason=sweep.stop_reason,
    )
    if plot is not None:
        result.plot(plot)
    return result


def _check_arguments(
    factory: Any, min_lr: float, max_lr: float, steps: int, beta: float, diverge: float
) -> None:
    if not callable(factory) or isinstance(factory, torch.nn.Module):
        raise TypeError(
            "lr_find needs a function that builds the Trainer (lr_find(lambda: Trainer(...))): "
            f"a Trainer's loop runs once, and the sweep is a run of its own; got {factory!r}"
        )
    if not 0 < min_lr < max_lr < math.inf:
        raise ValueError(f"lr_find needs 0 < min_lr < max_lr, got {min_lr!r} and {max_lr!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 3 <= steps <= 500:
        raise ValueError(f"lr_find steps must be an integer from 3 to 500, got {steps!r}")
    if not 0 <= beta < 1:
        raise ValueError(f"lr_find beta must be in [0, 1), got {beta!r}")
    if not diverge > 1:
        raise ValueError(f"lr_find diverge must be > 1, got {diverge!r}")
