"""Flag overfitting while it starts: train loss falling while evaluation loss rises.

Early stopping reacts once the evaluation loss has stopped beating its best,
which is after the damage. The trend shows earlier: over the last few epochs
the train loss keeps going down while the evaluation loss keeps going up. This
callback looks for exactly that and reports the gap ratio ``eval / train``,
which reads the same at any loss scale (2.0: evaluation loss twice the train
loss).

Per-epoch values, as the HPO trainer keeps them: the train loss of an epoch is the mean
of the losses logged during it (``ctx.logs["loss"]``, so it needs
``train.log_every``), the evaluation loss is the epoch's last evaluation
(``eval_at_epoch_end`` gives one per epoch). An epoch without both is left out.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from hookloop.callback import Callback
from hookloop.callbacks.monitor import as_float, check_metric_name
from hookloop.state import CallbackContext


class OverfitWarning(UserWarning):
    """Train loss fell and evaluation loss rose over a whole window of epochs."""


def is_diverging(train_losses: Sequence[float], eval_losses: Sequence[float], window: int) -> bool:
    """Whether, over the last ``window`` epoch-to-epoch changes (``window + 1`` values),
    every train loss is strictly below the previous one and every evaluation loss
    strictly above it. NaN compares false, so a NaN never looks like overfitting.

    >>> is_diverging([3, 2, 1], [1, 2, 3], window=2)
    True
    >>> is_diverging([3, 2, 1], [1, 2, 2], window=2)  # a flat step breaks the trend
    False
    """
    if window < 1 or len(train_losses) <= window or len(eval_losses) <= window:
        return False
    train = train_losses[-(window + 1) :]
    evals = eval_losses[-(window + 1) :]
    return all(b < a for a, b in pairwise(train)) and all(b > a for a, b in pairwise(evals))


def gap_ratio(train_loss: float, eval_loss: float) -> float:
    """``eval_loss / train_loss`` (inf for a non-positive train loss)."""
    return eval_loss / train_loss if train_loss > 0 else math.inf


class OverfitDetection(Callback):
    """After ``warmup_epochs`` epochs, warn when the last ``window_size`` epochs diverge.

    ``window_size=1`` fires on any single epoch where train loss fell and
    evaluation loss rose; larger windows ask for a sustained trend. When it
    fires: an :class:`OverfitWarning`, ``overfit_gap_ratio`` (``eval / train`` of
    that epoch) in ``ctx.user_state`` at once and in ``ctx.logs`` at each log
    event of the next epoch; ``gap_ratio`` holds it (None when the latest epoch
    did not fire). Evaluations outside a training run are not counted.
    """

    priority = 75

    def __init__(
        self,
        warmup_epochs: int = 5,
        window_size: int = 5,
        *,
        train_key: str = "loss",
        eval_key: str = "eval_loss",
    ) -> None:
        if (
            isinstance(warmup_epochs, bool)
            or not isinstance(warmup_epochs, int)
            or warmup_epochs < 0
        ):
            raise ValueError(f"warmup_epochs must be an int >= 0, got {warmup_epochs!r}")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be an int >= 1, got {window_size!r}")
        self.warmup_epochs = warmup_epochs
        self.window_size = window_size
        self.train_key = check_metric_name(train_key, "train_key")
        self.eval_key = check_metric_name(eval_key, "eval_key")
        self.train_history: list[float] = []
        self.eval_history: list[float] = []
        self.gap_ratio: float | None = None
        self._clear_epoch()
        self._warned_incomplete = False

    def _clear_epoch(self) -> None:
        self._train_sum = 0.0
        self._train_count = 0
        self._epoch_eval: float | None = None

    def on_epoch_start(self, ctx: CallbackContext) -> None:
        self._clear_epoch()

    def on_before_log(self, ctx: CallbackContext) -> None:
        logs = ctx.logs if ctx.logs is not None else {}
        value = as_float(logs.get(self.train_key))
        if value is not None:
            self._train_sum += value
            self._train_count += 1
        if self.gap_ratio is not None and ctx.logs is not None:
            ctx.logs["overfit_gap_ratio"] = self.gap_ratio

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if ctx.state.in_training and ctx.metrics is not None:
            value = as_float(ctx.metrics.get(self.eval_key))
            if value is not None:
                self._epoch_eval = value

    def on_epoch_end(self, ctx: CallbackContext) -> None:
        if not self._train_count or self._epoch_eval is None:
            self._incomplete_epoch(ctx)
            self._clear_epoch()
            return
        train_loss = self._train_sum / self._train_count
        self.train_history.append(train_loss)
        self.eval_history.append(self._epoch_eval)
        self._clear_epoch()
        epochs_done = ctx.state.epoch + 1
        if epochs_done > self.warmup_epochs and is_diverging(
            self.train_history, self.eval_history, self.window_size
        ):
            self.gap_ratio = gap_ratio(train_loss, self.eval_history[-1])
            ctx.user_state["overfit_gap_ratio"] = self.gap_ratio
            if ctx.state.is_rank_zero:
                warnings.warn(
                    f"OverfitDetection: over the last {self.window_size} epoch(s) to epoch "
                    f"{epochs_done} the train loss fell while {self.eval_key} rose; gap "
                    f"ratio {self.eval_key}/{self.train_key} = {self.gap_ratio:.3f}",
                    OverfitWarning,
                    stacklevel=2,
                )
        else:
            self.gap_ratio = None
            ctx.user_state.pop("overfit_gap_ratio", None)

    def _incomplete_epoch(self, ctx: CallbackContext) -> None:
        if self._warned_incomplete:
            return
        self._warned_incomplete = True
        missing = [] if self._train_count else [f"no logged {self.train_key!r} (train.log_every)"]
        if self._epoch_eval is None:
            missing.append(f"no evaluation with {self.eval_key!r}")
        warnings.warn(
            f"OverfitDetection: epoch {ctx.state.epoch + 1} had {' and '.join(missing)}; "
            "such epochs are left out of the overfitting check",
            stacklevel=2,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "train_history": list(self.train_history),
            "eval_history": list(self.eval_history),
            "gap_ratio": self.gap_ratio,
            "train_sum": self._train_sum,
            "train_count": self._train_count,
            "epoch_eval": self._epoch_eval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_history = [float(v) for v in state.get("train_history", [])]
        self.eval_history = [float(v) for v in state.get("eval_history", [])]
        self.gap_ratio = state.get("gap_ratio")
        self._train_sum = float(state.get("train_sum", 0.0))
        self._train_count = int(state.get("train_count", 0))
        self._epoch_eval = state.get("epoch_eval")

    def __repr__(self) -> str:
        return (
            f"OverfitDetection(warmup_epochs={self.warmup_epochs}, window_size={self.window_size})"
        )
