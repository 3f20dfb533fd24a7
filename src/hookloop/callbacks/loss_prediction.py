"""Extrapolate the evaluation loss curve to the end of the run.

During a hyper-parameter search most trials cannot run to completion. A fit of
``L(t) = A·exp(K·t)`` to the evaluation losses so far, extrapolated to the last
step, is a forward-looking signal: a trial whose predicted final loss is already
worse than the best finished one is probably wasted compute.

The fit is ordinary least squares on ``log L`` against ``t`` (numpy), which is
exact for a true exponential and cheap enough to redo after every evaluation.
Time ``t`` is the optimizer step of each evaluation, so evaluations at any
cadence (every N steps, every epoch, on request) lie on one axis; with one
evaluation per epoch this is the HPO trainer's per-epoch fit with the time axis scaled
by ``steps_per_epoch``, which predicts the same final value.

The published number is the HPO trainer's: ``-log10`` of the predicted final loss
(larger is better; 2.0 means a loss of 0.01). When the fit is impossible
(a non-positive or non-finite loss) or its prediction is not a finite positive
number, it falls back to ``-log10`` of the latest loss.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from hookloop.callback import Callback
from hookloop.callbacks.monitor import as_float, check_metric_name
from hookloop.state import CallbackContext


def fit_exponential(times: Sequence[float], losses: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares fit of ``log L = log A + K·t``; return ``(A, K)``, or None if impossible.

    Impossible: fewer than two points, times all equal, or a loss that is not a
    finite positive number (its logarithm does not exist).

    >>> a, k = fit_exponential([0, 1, 2], [2.0, 2.0 * math.exp(-0.5), 2.0 * math.exp(-1.0)])
    >>> round(a, 6), round(k, 6)
    (2.0, -0.5)
    """
    fitted = _fit_log_linear(times, losses)
    if fitted is None:
        return None
    t0, log_l0, k = fitted
    with np.errstate(over="ignore", under="ignore"):
        return float(np.exp(log_l0 - k * t0)), k


def predict_loss(times: Sequence[float], losses: Sequence[float], horizon: float) -> float | None:
    """The fitted curve's value at ``t = horizon`` (may be inf or 0.0); None if no fit."""
    fitted = _fit_log_linear(times, losses)
    if fitted is None:
        return None
    t0, log_l0, k = fitted
    with np.errstate(over="ignore", under="ignore"):
        return float(np.exp(log_l0 + k * (horizon - t0)))


def prediction_score(
    times: Sequence[float], losses: Sequence[float], horizon: float | None
) -> float | None:
    """``-log10`` of the predicted loss at ``horizon``, with the HPO trainer's fallback.

    Falls back to ``-log10(losses[-1])`` when there is no horizon, no fit, or the
    prediction is not finite and positive; None when the latest loss is not
    finite and positive either.

    >>> round(prediction_score([1, 2], [0.1, 0.01], horizon=3), 9)  # x0.1 a step: 0.001 at t=3
    3.0
    >>> prediction_score([1, 2], [0.1, float("nan")], horizon=3)  # no fit, no fallback
    """
    predicted = predict_loss(times, losses, horizon) if horizon is not None else None
    for candidate in (predicted, losses[-1] if len(losses) else None):
        if candidate is not None and math.isfinite(candidate) and candidate > 0:
            return -math.log10(candidate)
    return None


def _fit_log_linear(
    times: Sequence[float], losses: Sequence[float]
) -> tuple[float, float, float] | None:
    """Fit around the mean time (for conditioning); return ``(t0, log L at t0, K)``."""
    t = np.asarray(times, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if t.shape != y.shape or t.ndim != 1 or len(t) < 2:
        return None
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(y)) and np.all(y > 0)):
        return None
    t0 = float(t.mean())
    dt = t - t0
    denom = float(np.dot(dt, dt))
    if denom == 0.0:
        return None
    log_y = np.log(y)
    k = float(np.dot(dt, log_y - log_y.mean()) / denom)
    return t0, float(log_y.mean()), k


class LossPrediction(Callback):
    """Predicts the final evaluation loss from an exponential fit (see the module docstring).

    ``max_epochs`` (the HPO trainer's positional argument) or ``horizon_steps`` sets
    where to extrapolate to; by default the run's step budget
    (``state.max_steps``). Nothing is predicted before ``min_points``
    evaluations. Outputs, once there is a prediction: ``prediction`` (the
    ``-log10`` score), ``predicted_loss`` (the loss itself, or None after a
    fallback), ``ctx.user_state["predicted_final_loss"]`` and, at every log
    event from then on, ``ctx.logs["predicted_final_loss"]`` (the score, as the
    HPO trainer logs it). Evaluations outside a training run (a direct
    ``trainer.evaluate()``) are not counted.
    """

    priority = 70

    def __init__(
        self,
        max_epochs: int | None = None,
        *,
        monitor: str = "eval_loss",
        min_points: int = 10,
        horizon_steps: int | None = None,
    ) -> None:
        for name, value in (("max_epochs", max_epochs), ("horizon_steps", horizon_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if max_epochs is not None and horizon_steps is not None:
            raise ValueError("give max_epochs or horizon_steps, not both")
        if isinstance(min_points, bool) or not isinstance(min_points, int) or min_points < 2:
            raise ValueError(
                f"min_points must be an int >= 2 (a fit needs two), got {min_points!r}"
            )
        self.monitor = check_metric_name(monitor)
        self.max_epochs = max_epochs
        self.horizon_steps = horizon_steps
        self.min_points = min_points
        self.times: list[float] = []
        self.losses: list[float] = []
        self.prediction: float | None = None
        self.predicted_loss: float | None = None
        self._horizon: int | None = None
        self._warned_missing = False
        self._warned_horizon = False

    def on_train_start(self, ctx: CallbackContext) -> None:
        st = ctx.state
        if self.horizon_steps is not None:
            self._horizon = self.horizon_steps
        elif self.max_epochs is not None and st.steps_per_epoch:
            self._horizon = self.max_epochs * st.steps_per_epoch
        else:
            self._horizon = st.max_steps

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training or ctx.metrics is None:
            return
        value = as_float(ctx.metrics.get(self.monitor))
        if value is None:
            if not self._warned_missing:
                self._warned_missing = True
                warnings.warn(
                    f"LossPrediction: monitor {self.monitor!r} is not among the evaluation "
                    f"metrics {sorted(ctx.metrics or {})}; nothing will be predicted",
                    stacklevel=2,
                )
            return
        self.times.append(float(ctx.state.step))
        self.losses.append(value)
        if len(self.losses) < self.min_points:
            return
        if self._horizon is None and not self._warned_horizon:
            self._warned_horizon = True
            warnings.warn(
                "LossPrediction: the run has no step budget and the data no length, so there "
                "is no final step to extrapolate to; pass horizon_steps=. Until then it "
                "reports the fallback, -log10 of the latest loss.",
                stacklevel=2,
            )
        predicted = (
            predict_loss(self.times, self.losses, self._horizon)
            if self._horizon is not None
            else None
        )
        ok = predicted is not None and math.isfinite(predicted) and predicted > 0
        self.predicted_loss = predicted if ok else None
        self.prediction = prediction_score(self.times, self.losses, self._horizon)
        if self.prediction is not None:
            ctx.user_state["predicted_final_loss"] = self.prediction

    def on_before_log(self, ctx: CallbackContext) -> None:
        if self.prediction is not None and ctx.logs is not None:
            ctx.logs["predicted_final_loss"] = self.prediction

    def state_dict(self) -> dict[str, Any]:
        return {
            "times": list(self.times),
            "losses": list(self.losses),
            "prediction": self.prediction,
            "predicted_loss": self.predicted_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.times = [float(v) for v in state.get("times", [])]
        self.losses = [float(v) for v in state.get("losses", [])]
        self.prediction = state.get("prediction")
        self.predicted_loss = state.get("predicted_loss")

    def __repr__(self) -> str:
        return (
            f"LossPrediction(monitor={self.monitor!r}, min_points={self.min_points}, "
            f"max_epochs={self.max_epochs}, horizon_steps={self.horizon_steps})"
        )
