"""Run an HPO-trainer ``TrainingCallback`` inside a hookloop Trainer, as a native callback.

An :class:`HpoAdapter` wraps one HPO-trainer callback and keeps its priority, so HPO-trainer
and native callbacks interleave by priority in one ``CallbackManager``. When a
native event fires, the adapter calls the HPO-trainer hooks that
:mod:`hookloop.compat.mapping` lists for it, with the ``trainer`` view of
:mod:`hookloop.compat.hpo.trainer_view` and the keyword fields of :data:`FIELDS`.

Each adapter handles only the native events its HPO-trainer callback needs (its class
is made for that set of hooks by :func:`hookloop.compat._toolkit.adapt`, the one
adapter mechanism of every dialect), so an unused hook costs nothing per step
and ``describe_events()`` shows exactly where it runs. Build one with
:func:`adapt` (or ``as_native`` / ``CallbackRunner.native()``).

Stop: the HPO trainer ends training once a callback sets ``should_stop`` or
``nan_detected``. After each hook the adapter checks both and turns either into
``ctx.control.request_stop``, which the loop acts on at the end of the current
step (or epoch). A ``nan_detected`` stop reason carries NaNDetection's prefix, so
``objective_value`` scores the run as failed, as the HPO trainer does.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from hookloop.callbacks.nan_detection import REASON_PREFIX as NAN_PREFIX
from hookloop.compat._toolkit import DialectAdapter
from hookloop.compat._toolkit import adapt as _adapt
from hookloop.compat.hpo.callback import (
    EVENTS,
    TrainingCallback,
    check_training_callback,
    overridden_hooks,
)
from hookloop.compat.hpo.trainer_view import HpoTrainer, context_of
from hookloop.compat.mapping import dialect_events
from hookloop.state import CallbackContext
from hookloop.step import to_float

#: The keyword fields each HPO-trainer event gets inside a hookloop run.
#: ``epoch`` is 0-based; ``loss`` and ``grad_norm`` are 0-dim tensors (reading
#: one is a device sync); ``metrics`` holds the evaluation results under their
#: native names (``eval_loss`` ...); ``train_loss`` is the mean step loss of the
#: epoch; ``val_loss`` and ``metrics`` at ``on_epoch_end`` come from the epoch's
#: last evaluation (None and {} without one).
FIELDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "on_train_begin": (),
        "on_train_epoch_begin": ("epoch",),
        "on_train_step_end": ("epoch", "step", "batch_idx", "loss", "grad_norm"),
        "on_val_begin": ("epoch",),
        "on_val_end": ("epoch", "val_loss", "metrics"),
        "on_epoch_end": ("epoch", "train_loss", "val_loss", "metrics", "lr"),
        "on_train_end": (),
    }
)
assert tuple(FIELDS) == EVENTS

#: Native events an ``on_epoch_end`` hook needs besides its own, to total the epoch.
_EPOCH_TOTALS = frozenset({"on_epoch_start", "on_train_step_end", "on_eval_end"})
_STOP_FLAGS = ("should_stop", "nan_detected")


class _EpochTotals:
    """The epoch's mean train loss and last evaluation, for ``on_epoch_end``.

    The loss is summed on the device, so no step pays a host read; the one
    read is at the end of the epoch.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.steps = 0
        self.metrics: dict[str, float] = {}

    def add_step(self, ctx: CallbackContext) -> None:
        loss = (ctx.loss_dict or {}).get("loss")
        if loss is None:
            return
        loss = torch.as_tensor(loss).detach().float()
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.steps += 1

    def train_loss(self) -> float | None:
        return None if self.loss_sum is None else to_float(self.loss_sum) / self.steps


class HpoAdapter(DialectAdapter):
    """One HPO-trainer callback as a native hookloop callback (same priority, same name).

    ``adapt(callback)`` builds one that handles just the native events
    ``callback`` needs. An HPO-trainer callback with ``state_dict()``/``load_state_dict()``
    is saved and restored in checkpoints under its class name (or its ``name``
    attribute, when it has one).
    """

    built_by = "hookloop.compat.hpo.adapt(callback) (or as_native, CallbackRunner.native())"

    def __init__(self, callback: TrainingCallback) -> None:
        _check(callback)
        super().__init__(callback)
        self.priority = callback.priority
        self.hooks = overridden_hooks(callback)
        self.written: dict[str, None] = {}  # user_state keys the HPO-trainer callback wrote
        self._view: HpoTrainer | None = None
        self._epoch = _EpochTotals()

    @property
    def callback(self) -> TrainingCallback:
        """The HPO-trainer callback this adapter runs."""
        return self.wrapped

    def __repr__(self) -> str:
        return f"HpoAdapter({self.callback!r})"

    def trainer_view(self, ctx: CallbackContext) -> HpoTrainer:
        """The ``trainer`` the HPO-trainer hooks receive: one view per run context."""
        if self._view is None or context_of(self._view) is not ctx:
            self._view = HpoTrainer(ctx, self.written)
        return self._view

    # -- dispatch --------------------------------------------------------------
    def dispatch(self, native: str, ctx: CallbackContext) -> None:
        """Keep the epoch's totals, then call the HPO-trainer hooks mapped to ``native``."""
        if native == "on_epoch_start":
            self._epoch.reset()
        elif native == "on_train_step_end":
            self._epoch.add_step(ctx)
        elif native == "on_eval_end" and ctx.state.in_training:
            self._epoch.metrics = dict(ctx.metrics or {})
        for event in dialect_events("hpo").get(native, ()):
            if event in self.hooks:
                hook = getattr(self.callback, event)
                hook(self.trainer_view(ctx), **self._fields(event, ctx))
                if event != "on_train_end" and ctx.state.in_training:
                    self._forward_stop(ctx)

    def _fields(self, event: str, ctx: CallbackContext) -> dict[str, Any]:
        """The keyword fields of ``event`` (see :data:`FIELDS`) from the native context."""
        st = ctx.state
        if event in ("on_train_begin", "on_train_end"):
            return {}
        if event == "on_train_step_end":
            loss = (ctx.loss_dict or {}).get("loss")
            return {
                "epoch": st.epoch,
                "step": st.step,
                "batch_idx": st.epoch_step - 1,
                "loss": loss,
                "grad_norm": ctx.grad_norm,
            }
        if event == "on_val_end":
            metrics = dict(ctx.metrics or {})
            return {"epoch": st.epoch, "val_loss": metrics.get("eval_loss"), "metrics": metrics}
        if event == "on_epoch_end":
            metrics = dict(self._epoch.metrics)
            optimizer = ctx.optimizer
            return {
                "epoch": st.epoch,
                "train_loss": self._epoch.train_loss(),
                "val_loss": metrics.get("eval_loss"),
                "metrics": metrics,
                "lr": float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None,
            }
        return {"epoch": st.epoch}  # on_train_epoch_begin, on_val_begin

    def _forward_stop(self, ctx: CallbackContext) -> None:
        for flag in _STOP_FLAGS:
            if getattr(self.callback, flag, False):
                prefix = f"{NAN_PREFIX} " if flag == "nan_detected" else ""
                ctx.control.request_stop(
                    f"{prefix}{self.name} set {flag} (HPO-trainer stop signal)"
                )
                return

    # -- handing shared values on to loggers ------------------------------------
    def on_before_log(self, ctx: CallbackContext) -> None:
        """Put the numbers the HPO-trainer callback stored as ``trainer._<name>`` into ``ctx.logs``.

        That is how the HPO trainer's "store it on the trainer so the logger picks it
        up" reaches ``WandbLoggingCallback`` and every other native logger.
        Native values of the same name win.
        """
        if ctx.logs is None:
            return
        for key in self.written:
            value = ctx.user_state.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                ctx.logs.setdefault(key, value)


def adapt(callback: TrainingCallback) -> HpoAdapter:
    """The native callback for one HPO-trainer callback."""
    _check(callback)
    return _adapt(HpoAdapter, callback, _native_events(overridden_hooks(callback)))


def _check(callback: object) -> None:
    if not isinstance(callback, TrainingCallback):
        raise TypeError(
            f"HpoAdapter wraps an HPO-trainer TrainingCallback, got {type(callback).__name__}"
        )
    check_training_callback(callback)


def _native_events(hooks: frozenset[str]) -> frozenset[str]:
    """The native events that fire ``hooks``, plus what ``on_epoch_end`` totals need."""
    natives = {n for n, events in dialect_events("hpo").items() if hooks.intersection(events)}
    if "on_epoch_end" in hooks:
        natives |= _EPOCH_TOTALS
    return frozenset(natives)
