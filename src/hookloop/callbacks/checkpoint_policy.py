"""Decide *when* to checkpoint from the callback side: per epoch, per step, on a new best.

The HPO trainer's ``CheckpointCallback`` saved every N epochs and whenever the
monitored metric reached a new best. In hookloop the *what* and *where* belong
to ``hookloop.checkpoint.CheckpointManager`` (what is captured, atomic writes,
retention); this callback only asks for saves with ``ctx.control.request_save()``
and the loop writes them at the end of the step, or of the epoch. So it works
only when the Trainer has an ``out_dir``.

Retention stays in the config: ``checkpoint.keep_last`` keeps the newest K,
``checkpoint.keep_best`` with ``checkpoint.monitor`` keeps the best K. Set
``checkpoint.monitor`` to this callback's ``monitor`` (or ``keep_last`` to null),
or the best checkpoint saved here may be rotated out by newer ones; the callback
warns at the start of training when that can happen.

Running at priority 95, after every decider, a save requested here reflects
the fully evaluated state of its step or epoch. A subclass that saves elsewhere (the
HPO trainer's ``CheckpointCallback``) changes the two save points, :meth:`epoch_ended`
and :meth:`evaluated`, not the events.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from hookloop.callback import Callback
from hookloop.callbacks.monitor import MetricTracker, as_float, check_metric_name
from hookloop.state import CallbackContext


def _interval(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


class CheckpointPolicy(Callback):
    """Requests a checkpoint every ``every_n_epochs`` epochs, every ``every_n_steps``
    steps, and after each evaluation where ``monitor`` reaches a new best.

    ``mode`` and ``min_delta`` define "best" (see
    :class:`~hookloop.callbacks.monitor.MetricTracker`). After a best is saved,
    ``best_path`` (and ``ctx.user_state["best_checkpoint"]``) is its directory,
    ``best_step`` its step and ``best_value`` the metric.
    """

    priority = 95

    def __init__(
        self,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        *,
        monitor: str | None = None,
        mode: str = "min",
        min_delta: float = 0.0,
    ) -> None:
        self.every_n_epochs = _interval(every_n_epochs, "every_n_epochs")
        self.every_n_steps = _interval(every_n_steps, "every_n_steps")
        self.monitor = None if monitor is None else check_metric_name(monitor)
        self.tracker = MetricTracker(mode, min_delta)
        if self.every_n_epochs is None and self.every_n_steps is None and self.monitor is None:
            raise ValueError(
                "CheckpointPolicy needs every_n_epochs, every_n_steps or monitor; "
                "with none of them it would never ask for a checkpoint"
            )
        self.mode = mode
        self.best_path: str | None = None
        self.best_step: int | None = None
        self._new_best_step: int | None = None
        self._warned: set[str] = set()

    @property
    def best_value(self) -> float | None:
        return self.tracker.best

    def on_train_start(self, ctx: CallbackContext) -> None:
        if not ctx.run.can_checkpoint:
            self._warn_once(
                "no_out_dir",
                "CheckpointPolicy: the Trainer has no out_dir, so no checkpoint can be "
                "written; pass Trainer(out_dir=...)",
            )
        cfg = getattr(ctx.config, "checkpoint", None)
        if (
            self.monitor is not None
            and cfg is not None
            and cfg.keep_last is not None
            and cfg.monitor != self.monitor
        ):
            self._warn_once(
                "retention",
                f"CheckpointPolicy: checkpoint.keep_last={cfg.keep_last} keeps only the newest "
                f"checkpoints and checkpoint.monitor is {cfg.monitor!r}, not {self.monitor!r}, "
                "so the best checkpoint may be deleted by later saves; set "
                f"checkpoint.monitor={self.monitor} (and checkpoint.mode) to keep it",
            )

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if self.every_n_steps and ctx.state.step % self.every_n_steps == 0:
            ctx.control.request_save()

    def on_epoch_end(self, ctx: CallbackContext) -> None:
        self.epoch_ended(ctx)

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if ctx.state.in_training and ctx.metrics is not None:
            self.evaluated(ctx, ctx.metrics)

    # -- the save points: what a subclass that saves elsewhere changes -----------------
    def epoch_ended(self, ctx: CallbackContext) -> None:
        """An epoch ended: every ``every_n_epochs``-th asks for a save."""
        if self.every_n_epochs and (ctx.state.epoch + 1) % self.every_n_epochs == 0:
            ctx.control.request_save()

    def evaluated(self, ctx: CallbackContext, metrics: Mapping[str, Any]) -> None:
        """An evaluation in training ended with ``metrics``: a new best of ``monitor`` asks
        for a save, which becomes the best checkpoint."""
        if self.monitor is None:
            return
        value = as_float(metrics.get(self.monitor))
        if value is None:
            self._warn_once(
                "missing",
                f"CheckpointPolicy: monitor {self.monitor!r} is not among the evaluation "
                f"metrics {sorted(metrics or {})}; no best checkpoint is kept",
            )
            return
        if self.tracker.update(value):
            self._new_best_step = ctx.state.step
            ctx.control.request_save()

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        # The save at the step of a new best holds the best weights, whoever asked for it.
        if self._new_best_step is not None and self._new_best_step == ctx.state.step:
            self.best_path = str(ctx.checkpoint_path)
            self.best_step = ctx.state.step
            ctx.user_state["best_checkpoint"] = self.best_path
        # A best whose step was never saved is gone; an older save announced late (an
        # asynchronous save commits while training goes on) leaves it pending.
        if self._new_best_step is not None and self._new_best_step <= ctx.state.step:
            self._new_best_step = None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        # A checkpoint saved at a new best could not know its own path when it was captured.
        if self.best_step is not None and self.best_step == ctx.state.step:
            self.best_path = str(ctx.checkpoint_path)
        if self.best_path is not None:
            ctx.user_state["best_checkpoint"] = self.best_path

    def state_dict(self) -> dict[str, Any]:
        pending = self._new_best_step is not None  # this very save is the new best
        return {
            "tracker": self.tracker.state_dict(),
            "best_path": None if pending else self.best_path,
            "best_step": self._new_best_step if pending else self.best_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state.get("tracker", {}))
        self.best_path = state.get("best_path")
        self.best_step = state.get("best_step")
        self._new_best_step = None

    def __repr__(self) -> str:
        return (
            f"CheckpointPolicy(every_n_epochs={self.every_n_epochs}, "
            f"every_n_steps={self.every_n_steps}, monitor={self.monitor!r}, mode={self.mode!r})"
        )
