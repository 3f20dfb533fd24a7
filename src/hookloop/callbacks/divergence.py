"""Divergence detection: stop, abort, or rewind when the loss runs away.

:class:`SpikeTracker` is the logic, on plain numbers: an exponential moving
average (EMA) of the observed loss and the lowest value that average has
reached. An observation is *above* when the average has risen at least
``threshold`` over that best value (absolute), or to at least
``relative_threshold`` times it (relative; only while the best is positive).
``patience`` consecutive observations above trigger; a NaN or infinite loss
triggers at once. The first ``warmup`` observations are never above (they
still feed the average), which keeps the steep early part of training from
counting.

:class:`DivergenceDetector` feeds it the logged training loss (or
``eval_loss``, or any key) and asks the loop to stop, abort, or rewind. It reads
values the loop has already turned into Python numbers for logging, so it adds
no device synchronisation.

With ``action="rewind"`` it asks the loop to roll back to the last checkpoint
taken before the divergence began (:mod:`hookloop.checkpoint.rewind`). The divergence is
taken to begin right after the last observation that was not above (the steps
since then may all have fed the spike). After ``max_rewinds`` rewinds the next
divergence ends the run as failed (an abort: the checkpoints from before the
divergence stay ``latest``). With ``action="rewind"`` a step skipped for a
NaN/Inf loss or gradient (``state.nonfinite_steps``; its loss never reaches the
logs) is a divergence at once too.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from hookloop.callback import Callback
from hookloop.state import CallbackContext

Limit = float | None  # a threshold, or None for "not used"
Count = int  # observations (log events or evaluations), not steps
Action = Literal["stop", "abort", "rewind"]
ACTIONS = ("stop", "abort", "rewind")

log = logging.getLogger("hookloop.divergence")


class SpikeTracker:
    """EMA-versus-best spike detection with patience and warmup (see the module doc).

    >>> t = SpikeTracker(smoothing=0.5, threshold=1.0, patience=2, warmup=0)
    >>> [t.update(x) is not None for x in (3.0, 3.0, 6.0, 6.0, 6.0)]
    [False, False, False, True, True]
    """

    def __init__(
        self,
        smoothing: float = 0.3,
        threshold: Limit = 1.0,
        relative_threshold: Limit = None,
        patience: Count = 3,
        warmup: Count = 10,
    ) -> None:
        if not _real(smoothing) or not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be a number in (0, 1], got {smoothing!r}")
        if threshold is not None and (not _real(threshold) or not threshold > 0):
            raise ValueError(f"threshold must be a number > 0 or None, got {threshold!r}")
        if relative_threshold is not None and (
            not _real(relative_threshold) or not relative_threshold > 1
        ):
            raise ValueError(
                f"relative_threshold must be a number > 1 or None, got {relative_threshold!r}"
            )
        if threshold is None and relative_threshold is None:
            raise ValueError("set threshold, relative_threshold, or both (both are None)")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        self.smoothing = float(smoothing)
        self.threshold = threshold
        self.relative_threshold = relative_threshold
        self.patience = patience
        self.warmup = warmup
        self.reset()

    def reset(self) -> None:
        self.smoothed: float | None = None
        self.best: float | None = None
        self.observations = 0
        self.consecutive = 0

    def update(self, value: float) -> str | None:
        """Feed one observation; return why it diverged, or None while healthy."""
        value = float(value)
        if not math.isfinite(value):
            return f"non-finite value {value}"
        self.observations += 1
        if self.smoothed is None or self.best is None:
            self.smoothed = self.best = value
            return None
        self.smoothed += self.smoothing * (value - self.smoothed)
        self.best = min(self.best, self.smoothed)
        if self.observations <= self.warmup:
            return None
        reasons = self._above(self.smoothed, self.best)
        if not reasons:
            self.consecutive = 0
            return None
        self.consecutive += 1
        if self.consecutive < self.patience:
            return None
        return (
            f"smoothed {self.smoothed:.4g} vs best {self.best:.4g} "
            f"({'; '.join(reasons)}) for {self.consecutive} observations"
        )

    def _above(self, smoothed: float, best: float) -> list[str]:
        reasons = []
        if self.threshold is not None and smoothed - best >= self.threshold:
            reasons.append(f"rise {smoothed - best:.4g} >= threshold {self.threshold:g}")
        if (
            self.relative_threshold is not None
            and best > 0
            and smoothed / best >= self.relative_threshold
        ):
            reasons.append(
                f"ratio {smoothed / best:.4g} >= relative_threshold {self.relative_threshold:g}"
            )
        return reasons

    def state_dict(self) -> dict[str, Any]:
        return {
            "smoothed": self.smoothed,
            "best": self.best,
            "observations": self.observations,
            "consecutive": self.consecutive,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.smoothed = state["smoothed"]
        self.best = state["best"]
        self.observations = int(state["observations"])
        self.consecutive = int(state["consecutive"])


class DivergenceDetector(Callback):
    """Stops training when the monitored loss diverges (see the module doc).

    Parameters keep Forgather's names and meaning: ``smoothing`` (EMA weight of
    the newest value, in (0, 1]), ``threshold`` (absolute rise of the average
    over its best; ``None`` disables), ``relative_threshold`` (ratio of the
    average to its best, > 1; ``None`` disables), ``patience``, ``warmup``
    (observations), ``action`` (``"stop"``: finish the step and save;
    ``"abort"``: end at once without saving; ``"rewind"``: roll back and go on),
    ``use_eval_loss`` (watch ``eval_loss`` at each evaluation instead of the
    training loss at each log) and ``metric_key`` (any other key, looked up in
    logs and evaluation results).

    Rewind settings (``action="rewind"`` only): ``skip_batches`` (batches per
    rank skipped from where the divergence began; None: those trained between
    its start and its confirmation), ``lr_factor`` and ``lr_steps`` (the
    learning rate is multiplied by ``lr_factor`` for ``lr_steps`` steps after
    the restored one; 1.0 or 0: unchanged) and ``max_rewinds`` (rewinds before
    a divergence fails the run).
    """

    priority = 80

    def __init__(
        self,
        smoothing: float = 0.3,
        *,
        # what counts as a spike (either threshold may be None to turn it off)
        threshold: Limit = 1.0,
        relative_threshold: Limit = None,
        # how long it must last, and how much of the start is ignored
        patience: Count = 3,
        warmup: Count = 10,
        # what is watched and what happens
        metric_key: str | None = None,
        use_eval_loss: bool = False,
        action: Action = "stop",
        # what a rewind does (action="rewind")
        skip_batches: int | None = None,
        lr_factor: float = 1.0,
        lr_steps: int = 0,
        max_rewinds: int = 3,
    ) -> None:
        self.tracker = SpikeTracker(smoothing, threshold, relative_threshold, patience, warmup)
        if action not in ACTIONS:
            raise ValueError(f"action must be 'stop', 'abort' or 'rewind', got {action!r}")
        if skip_batches is not None and (not _count(skip_batches) or skip_batches < 0):
            raise ValueError(f"skip_batches must be an int >= 0 or None, got {skip_batches!r}")
        if not _real(lr_factor) or not lr_factor > 0:
            raise ValueError(f"lr_factor must be a finite number > 0, got {lr_factor!r}")
        if not _count(lr_steps) or lr_steps < 0:
            raise ValueError(f"lr_steps must be an int >= 0, got {lr_steps!r}")
        if not _count(max_rewinds) or max_rewinds < 0:
            raise ValueError(f"max_rewinds must be an int >= 0, got {max_rewinds!r}")
        if not isinstance(use_eval_loss, bool):
            raise ValueError(f"use_eval_loss must be True or False, got {use_eval_loss!r}")
        if metric_key is not None and (not isinstance(metric_key, str) or not metric_key):
            raise ValueError(f"metric_key must be a metric name or None, got {metric_key!r}")
        self.action = action
        if action != "rewind":  # its per-step check is for rewinds alone
            self.on_train_step_end = None  # type: ignore[method-assign, assignment]  # None: not dispatched
        self.use_eval_loss = use_eval_loss
        self.metric_key = metric_key
        self.key = metric_key or ("eval_loss" if use_eval_loss else "loss")
        self.skip_batches = skip_batches
        self.lr_factor = float(lr_factor)
        self.lr_steps = lr_steps
        self.max_rewinds = max_rewinds
        self.triggered: str | None = None  # the latest reason, for inspection
        self.healthy_step = 0  # the step of the latest observation that was not above
        self._nonfinite_seen = 0  # state.nonfinite_steps already acted on

    @property
    def name(self) -> str:
        """``DivergenceDetector``, or ``DivergenceDetector[key]`` when not watching ``loss``."""
        return "DivergenceDetector" if self.key == "loss" else f"DivergenceDetector[{self.key}]"

    # Forgather's attribute names, read through to the tracker.
    smoothing = property(lambda self: self.tracker.smoothing)
    threshold = property(lambda self: self.tracker.threshold)
    relative_threshold = property(lambda self: self.tracker.relative_threshold)
    patience = property(lambda self: self.tracker.patience)
    warmup = property(lambda self: self.tracker.warmup)

    def on_train_start(self, ctx: CallbackContext) -> None:
        self._nonfinite_seen = ctx.state.nonfinite_steps

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        self._nonfinite_seen = ctx.state.nonfinite_steps

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        # A NaN/Inf step is skipped and its loss kept out of the logs: with action="rewind"
        # it is a divergence too (an int comparison; the loop already read the flag).
        if self.action == "rewind" and ctx.state.nonfinite_steps != self._nonfinite_seen:
            self._nonfinite_seen = ctx.state.nonfinite_steps
            self.triggered = "non-finite loss or gradient (the step's update was skipped)"
            self._diverged(ctx, self.triggered)

    def on_log(self, ctx: CallbackContext) -> None:
        self._observe(ctx, ctx.logs)

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._observe(ctx, ctx.metrics)

    def _observe(self, ctx: CallbackContext, values: dict[str, Any] | None) -> None:
        if not values or self.key not in values:
            return
        value = values[self.key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        why = self.tracker.update(value)
        if why is None:
            if self.tracker.consecutive == 0:
                self.healthy_step = ctx.state.step
            return
        self.triggered = why
        self._diverged(ctx, f"{self.key} {why}")

    def _diverged(self, ctx: CallbackContext, what: str) -> None:
        reason = f"divergence: {what}"
        action = self.action
        rewinds = len(ctx.state.rewinds)
        if action == "rewind" and rewinds >= self.max_rewinds:
            action = "abort"
            reason += f"; gave up after {rewinds} rewinds (max_rewinds={self.max_rewinds})"
        if ctx.state.is_rank_zero:
            log.error("%s at step %d; action: %s", reason, ctx.state.step, action)
        if action == "rewind":
            ctx.control.request_rewind(
                self.healthy_step + 1,
                reason=reason,
                skip_batches=self.skip_batches,
                lr_factor=self.lr_factor,
                lr_steps=self.lr_steps,
            )
        elif action == "abort":
            ctx.control.request_abort(reason, failed=True)
        else:
            ctx.control.request_stop(reason, failed=True)

    def state_dict(self) -> dict[str, Any]:
        return {**self.tracker.state_dict(), "healthy_step": self.healthy_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state)
        self.healthy_step = int(state.get("healthy_step", 0))

    def __repr__(self) -> str:
        return (
            f"DivergenceDetector(priority={self.priority}, key={self.key!r}, "
            f"action={self.action!r})"
        )


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _real(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
