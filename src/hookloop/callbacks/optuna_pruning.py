"""Report evaluations to an Optuna trial and end the trials its pruner gives up on.

During a hyper-parameter search most trials are visibly worse than the best
long before they finish. Each evaluation during training is reported to the
trial (``trial.report(value, step)``); when the study's pruner answers
``trial.should_prune()``, the run ends:

- ``raise_pruned=True`` (the default, as in the HPO trainer): ``optuna.TrialPruned`` is
  raised from ``on_eval_end``. The user sees ``trainer.train()`` raise it, with a
  note naming this callback and the event; ``on_exception`` runs, nothing is
  saved, and ``study.optimize`` records the trial as PRUNED.
- ``raise_pruned=False``: a stop is requested instead, so the run ends the
  ordinary way (a checkpoint if configured, ``on_train_end``), and
  ``train()`` returns with ``stop_reason`` saying it was pruned. Pass the result
  to :func:`objective_value`, which raises ``TrialPruned`` for it. Use this mode
  with several processes: the stop request is agreed across ranks, an exception
  on rank 0 is not.

:func:`objective_value` also gives the HPO trainer's value for a failed run: ``inf``
(``-inf`` when maximizing) when NaNDetection stopped it or the metric is
missing or not finite, so the study ranks it last.

Only rank 0 talks to the trial. optuna is imported when this is used; without
it the error names the extra to install (``hookloop[optuna]``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from hookloop._optional import require
from hookloop.callback import Callback
from hookloop.callbacks.monitor import as_float, check_metric_name
from hookloop.callbacks.nan_detection import is_nonfinite_stop
from hookloop.state import CallbackContext

#: Every pruning stop reason starts with this (see :func:`objective_value`).
REASON_PREFIX = "OptunaPruning:"

REPORT_STEPS = ("step", "eval")
DIRECTIONS = ("minimize", "maximize")


def _optuna() -> Any:
    return require("optuna", extra="optuna", feature="OptunaPruning")


def is_pruned_stop(stop_reason: str | None) -> bool:
    """Whether a run's ``stop_reason`` says OptunaPruning ended it."""
    return stop_reason is not None and REASON_PREFIX in stop_reason


def objective_value(result: Any, monitor: str = "eval_loss", direction: str = "minimize") -> float:
    """What an Optuna objective should return for a finished ``TrainResult``.

    - pruned (``OptunaPruning(raise_pruned=False)`` stopped it): raises
      ``optuna.TrialPruned``, so the trial is recorded as pruned;
    - failed (NaNDetection stopped it, or ``metrics[monitor]`` is missing or not
      finite): ``inf`` for ``direction="minimize"``, ``-inf`` for ``"maximize"``
      (the HPO trainer returns ``val_loss = inf``);
    - otherwise the final ``metrics[monitor]``.
    """
    check_metric_name(monitor)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'minimize' or 'maximize', got {direction!r}")
    worst = math.inf if direction == "minimize" else -math.inf
    reason = getattr(result, "stop_reason", None)
    if is_pruned_stop(reason):
        raise _optuna().TrialPruned(reason)
    if is_nonfinite_stop(reason):
        return worst
    value = as_float((getattr(result, "metrics", None) or {}).get(monitor))
    if value is None or not math.isfinite(value):
        return worst
    return value


class OptunaPruning(Callback):
    """Reports ``monitor`` to ``trial`` after each evaluation; prunes when its pruner says so.

    ``report_step`` is the step number given to Optuna: ``"step"`` (the
    optimizer step, the default; comparable across trials with the same
    evaluation cadence, and unchanged by a resume) or ``"eval"`` (the
    evaluation's index, 0-based, as the HPO trainer's per-epoch report). See the
    module docstring for what a pruned run looks like. ``pruned`` tells whether
    this run was pruned.
    """

    priority = 85

    def __init__(
        self,
        trial: Any,
        monitor: str = "eval_loss",
        *,
        raise_pruned: bool = True,
        report_step: str = "step",
    ) -> None:
        optuna = _optuna()
        if not isinstance(trial, optuna.trial.BaseTrial):
            raise ValueError(
                "trial must be an optuna trial (optuna.trial.Trial, as passed to the objective), "
                f"got {type(trial).__name__}"
            )
        if not isinstance(raise_pruned, bool):
            raise ValueError(f"raise_pruned must be True or False, got {raise_pruned!r}")
        if report_step not in REPORT_STEPS:
            raise ValueError(f"report_step must be 'step' or 'eval', got {report_step!r}")
        self.trial = trial
        self.monitor = check_metric_name(monitor)
        self.raise_pruned = raise_pruned
        self.report_step = report_step
        self.pruned = False
        self.evaluations = 0
        self._warned_missing = False

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training or ctx.metrics is None:
            return  # e.g. a final trainer.evaluate(): it would re-report the last step
        index = self.evaluations
        self.evaluations += 1
        if not ctx.state.is_rank_zero:
            return
        value = as_float((ctx.metrics or {}).get(self.monitor))
        if value is None:
            if not self._warned_missing:
                self._warned_missing = True
                warnings.warn(
                    f"OptunaPruning: monitor {self.monitor!r} is not among the evaluation "
                    f"metrics {sorted(ctx.metrics or {})}; nothing is reported to the trial",
                    stacklevel=2,
                )
            return
        step = ctx.state.step if self.report_step == "step" else index
        self.trial.report(value, step)
        if not self.trial.should_prune():
            return
        self.pruned = True
        reason = (
            f"{REASON_PREFIX} trial {self.trial.number} pruned at step {ctx.state.step} "
            f"({self.monitor}={value:.6g})"
        )
        if self.raise_pruned:
            raise _optuna().TrialPruned(reason)
        ctx.control.request_stop(reason)

    def state_dict(self) -> dict[str, Any]:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evaluations = int(state.get("evaluations", 0))

    def __repr__(self) -> str:
        return (
            f"OptunaPruning(trial={getattr(self.trial, 'number', '?')}, "
            f"monitor={self.monitor!r}, raise_pruned={self.raise_pruned})"
        )
