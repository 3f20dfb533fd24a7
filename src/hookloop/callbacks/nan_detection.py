"""Stop a run whose loss has gone NaN or Inf, instead of training on garbage.

A NaN loss rarely crashes anything: the run carries on, logs ``nan`` for hours
and only looks broken afterwards. This callback ends it at the step where it
happened and says why in ``TrainResult.stop_reason``.

It adds no host-device sync. It reads only values the loop has already brought
to the host:

- With ``train.skip_nonfinite`` on (the default) the loop checks every step's
  loss and gradients and counts the bad steps in ``state.nonfinite_steps``. A
  rise in that counter at ``on_train_step_end`` means this step was non-finite,
  so a NaN at step k stops training at step k.
- The logged values (``ctx.logs``) on log steps. This is what catches a NaN
  when ``skip_nonfinite`` is off (or an fp16 GradScaler does the skipping), at
  the first log step at or after it.
- The evaluation metrics at ``on_eval_end``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.state import CallbackContext

#: Every stop reason this callback files starts with this, so code that reads
#: ``TrainResult.stop_reason`` can tell a non-finite stop apart (see :func:`is_nonfinite_stop`).
REASON_PREFIX = "NaNDetection:"

ACTIONS = ("stop", "abort")


def is_nonfinite_stop(stop_reason: str | None) -> bool:
    """Whether a run's ``stop_reason`` says NaNDetection ended it."""
    return stop_reason is not None and REASON_PREFIX in stop_reason


class NaNDetection(Callback):
    """Ends training at the first NaN/Inf loss (see the module docstring for where it looks).

    ``keys`` are the metric names checked in ``ctx.logs`` and in evaluation
    metrics (default: the train ``loss`` and ``eval_loss``). ``action="stop"``
    ends training the ordinary way (a checkpoint is saved if checkpointing is
    on; with ``skip_nonfinite`` the bad update was never applied, so the weights
    are sound); ``"abort"`` ends it without saving. After the run,
    ``nan_detected`` is True and ``reason`` says which value, at which step.
    """

    priority = 5

    def __init__(
        self, *, keys: Iterable[str] = ("loss", "eval_loss"), action: str = "stop"
    ) -> None:
        if isinstance(keys, str) or not isinstance(keys, Iterable):
            raise ValueError(f"keys must be a list of metric names, got {keys!r}")
        keys = tuple(keys)
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"keys must be a non-empty list of metric names, got {keys!r}")
        if action not in ACTIONS:
            raise ValueError(f"action must be 'stop' or 'abort', got {action!r}")
        self.keys = keys
        self.action = action
        self.nan_detected = False
        self.reason: str | None = None
        self._seen_nonfinite = 0

    def on_train_start(self, ctx: CallbackContext) -> None:
        self.nan_detected = False
        self.reason = None
        self._seen_nonfinite = ctx.state.nonfinite_steps  # after a resume, not 0

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        if ctx.rewind is not None:  # rolled back to before the divergence: watch afresh
            self.on_train_start(ctx)

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        # An int comparison: the loop already read the finiteness flag for this step.
        if ctx.state.nonfinite_steps == self._seen_nonfinite:
            return
        self._seen_nonfinite = ctx.state.nonfinite_steps
        what, value = "gradient norm", ctx.grad_norm
        loss = (ctx.loss_dict or {}).get("loss")
        # Reading the loss here is a host read, but only on the step that already failed.
        if loss is not None and not bool(torch.isfinite(torch.as_tensor(loss)).all()):
            what, value = "loss", loss
        self._detected(ctx, what, value, "the step's update was skipped")

    def on_before_log(self, ctx: CallbackContext) -> None:
        self._check(ctx, ctx.logs or {}, "logged")

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._check(ctx, ctx.metrics or {}, "evaluation")

    def _check(self, ctx: CallbackContext, values: dict[str, Any], where: str) -> None:
        for key in self.keys:
            value = values.get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                self._detected(ctx, key, value, f"{where} value")
                return

    def _detected(self, ctx: CallbackContext, what: str, value: Any, detail: str) -> None:
        if self.nan_detected:
            return  # one request per run is enough
        if isinstance(value, torch.Tensor):
            value = value.detach().float().reshape(-1)[0].item()
        shown = f" ({value})" if value is not None else ""
        self.nan_detected = True
        self.reason = (
            f"{REASON_PREFIX} non-finite {what}{shown} at step {ctx.state.step} ({detail})"
        )
        if self.action == "abort":
            ctx.control.request_abort(self.reason, failed=True)
        else:
            ctx.control.request_stop(self.reason, failed=True)

    def __repr__(self) -> str:
        return f"NaNDetection(keys={list(self.keys)!r}, action={self.action!r})"
