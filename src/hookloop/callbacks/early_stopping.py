"""Stop training once the monitored metric(s) stop improving.

Past convergence more steps only cost compute (and may overfit). Each
evaluation during training updates one :class:`~hookloop.callbacks.monitor.MetricTracker`
per monitored metric; a tracker that has gone ``patience`` evaluations in a row
without improving by more than ``min_delta`` has run out of patience. With one
metric that ends the run; with several (``monitors={...}``) ``require="any"``
ends it when any has run out and ``require="all"`` only when all have at once.

``min_delta`` is absolute by default (``threshold_mode="abs"``: eval loss must
drop by more than ``min_delta``). ``threshold_mode="rel"`` makes it a fraction of
the best value, which is how the HPO trainer reads it (``min_delta=1e-4``: 0.01 %).

A monitored metric missing from the evaluation results is warned about once and
then skipped: with ``require="any"`` the others still decide; with
``require="all"`` (or a single monitor) the run cannot stop early, as the
warning says.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from hookloop.callback import Callback
from hookloop.callbacks.monitor import MetricTracker, as_float, check_metric_name, check_mode
from hookloop.state import CallbackContext

REQUIRE = ("any", "all")


class EarlyStopping(Callback):
    """Requests a stop when the monitor(s) have not improved for ``patience`` evaluations.

    ``EarlyStopping(monitor="eval_loss", mode="min", patience=3)``, or several at
    once: ``EarlyStopping(monitors={"eval_loss": "min", "eval_acc": "max"},
    require="all")``. Patience and ``min_delta`` apply to every monitor. The stop
    reason names the exhausted monitor(s), their best values and the patience;
    ``should_stop`` and ``stopped_step`` record it. Evaluations outside a
    training run (a direct ``trainer.evaluate()``) are not counted. Its state
    (best values, counters) is saved in checkpoints under ``name``
    (``EarlyStopping[eval_loss]``), so several instances can coexist.
    """

    priority = 90

    def __init__(
        self,
        monitor: str = "eval_loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        *,
        monitors: Mapping[str, str] | None = None,
        require: str = "any",
        threshold_mode: str = "abs",
    ) -> None:
        if monitors is not None:
            if monitor != "eval_loss" or mode != "min":
                raise ValueError("give monitor=/mode= or monitors={name: mode}, not both")
            if not isinstance(monitors, Mapping) or not monitors:
                raise ValueError(
                    "monitors must be a non-empty mapping of metric name to 'min' or 'max', "
                    f"got {monitors!r}"
                )
            spec = {
                check_metric_name(k, "monitors key"): check_mode(v, f"monitors[{k!r}]")
                for k, v in monitors.items()
            }
        else:
            spec = {check_metric_name(monitor): check_mode(mode)}
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1 (evaluations), got {patience!r}")
        if require not in REQUIRE:
            raise ValueError(f"require must be 'any' or 'all', got {require!r}")
        self.monitors = spec
        self.patience = patience
        self.min_delta = min_delta
        self.require = require
        self.threshold_mode = threshold_mode
        self.trackers = {
            name: MetricTracker(m, min_delta, threshold_mode) for name, m in spec.items()
        }
        self.best_steps: dict[str, int | None] = dict.fromkeys(spec)
        self.should_stop = False
        self.stopped_step: int | None = None
        self._warned: set[str] = set()

    @property
    def name(self) -> str:
        return f"EarlyStopping[{','.join(self.monitors)}]"

    @property
    def monitor(self) -> str:
        """The first (with one monitor: the only) monitored metric."""
        return next(iter(self.monitors))

    def on_train_start(self, ctx: CallbackContext) -> None:
        self.should_stop = False
        self.stopped_step = None

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training or ctx.metrics is None:
            return
        metrics = ctx.metrics
        for key, tracker in self.trackers.items():
            value = as_float(metrics.get(key))
            if value is None:
                self._warn_missing(key, metrics)
                continue
            if tracker.update(value):
                self.best_steps[key] = ctx.state.step
        exhausted = [k for k, t in self.trackers.items() if t.bad_count >= self.patience]
        done = all if self.require == "all" else any
        if exhausted and done(k in exhausted for k in self.trackers):
            self.should_stop = True
            self.stopped_step = ctx.state.step
            ctx.control.request_stop(self._reason(exhausted))

    def _reason(self, exhausted: list[str]) -> str:
        parts = []
        for k in exhausted:
            t = self.trackers[k]
            best = (
                f"best {t.best:.6g} at step {self.best_steps[k]}"
                if t.best is not None
                else "no finite value"
            )
            parts.append(f"{k} ({best}; {t.bad_count} evaluations without improvement)")
        extra = f", require={self.require!r}" if len(self.trackers) > 1 else ""
        return (
            f"EarlyStopping: no improvement by more than min_delta={self.min_delta:g} "
            f"({self.threshold_mode}) in {', '.join(parts)} (patience={self.patience}{extra})"
        )

    def _warn_missing(self, key: str, metrics: Mapping[str, Any]) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        consequence = (
            "the other monitors still decide"
            if self.require == "any" and len(self.trackers) > 1
            else "training cannot stop early on it"
        )
        warnings.warn(
            f"EarlyStopping: monitor {key!r} is not among the evaluation metrics "
            f"{sorted(metrics)}; {consequence}",
            stacklevel=2,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "trackers": {k: t.state_dict() for k, t in self.trackers.items()},
            "best_steps": dict(self.best_steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, tracker_state in state.get("trackers", {}).items():
            if key in self.trackers:
                self.trackers[key].load_state_dict(tracker_state)
        for key, step in state.get("best_steps", {}).items():
            if key in self.best_steps:
                self.best_steps[key] = step

    def __repr__(self) -> str:
        return (
            f"EarlyStopping(monitors={self.monitors!r}, patience={self.patience}, "
            f"min_delta={self.min_delta}, require={self.require!r})"
        )
