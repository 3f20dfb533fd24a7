"""A trial's life: trained as an ordinary hookloop run in ``trial-NNNN/``, scored, and
told to the study as COMPLETE, PRUNED or FAIL (with the reason).

:func:`train_trial` builds and trains the run (every rank calls it); :func:`run_trial`
adds what rank 0 does around it: resuming an interrupted trial's checkpoint, copying its
output to ``console.log``, and recording how it ended. :class:`BestMetric` is what a
trial is scored by.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from hookloop.callback import Callback
from hookloop.callbacks.monitor import as_float
from hookloop.config import dump_yaml
from hookloop.rundir import RunDir, is_checkpoints_folder
from hookloop.state import CallbackContext
from hookloop.tune.claims import host_name, requeue
from hookloop.tune.interrupts import Interrupts, StudyInterrupted
from hookloop.tune.space import apply_params
from hookloop.tune.spec import (
    CONSOLE_LOG,
    CONSTRAINT_ATTR,
    PARAM_COUNT,
    TuneSpec,
    optuna,
    trial_dir,
    trials_set_constraints,
)
from hookloop.tune.storage import retry_locked


def take_over_run_dir(study_dir: Path, trial: Any) -> bool:
    """For a retry of an interrupted trial: move the interrupted trial's run directory (with
    its checkpoints) to this trial's, so that it resumes there. False (start from scratch)
    when that directory is on another machine or holds no checkpoint."""
    old = trial.user_attrs.get("resume_from")
    if not old or trial.user_attrs.get("resume_host") != host_name():
        return False
    old_dir, new_dir = Path(old), trial_dir(study_dir, trial.number)
    if not is_checkpoints_folder(RunDir(old_dir).checkpoints) or new_dir.exists():
        return False
    shutil.move(str(old_dir), str(new_dir))
    return True


class BestMetric(Callback):
    """What a trial is scored by: the best value of each objective metric over the run's
    evaluations (each in its own direction), the last evaluation's metrics (for the
    constraints) and the model's parameter count (``param_count``)."""

    priority = 84  # just before OptunaPruning (85): both read the same evaluation

    def __init__(self, metric: str | list[str], direction: str | list[str]) -> None:
        self.metrics = [metric] if isinstance(metric, str) else list(metric)
        given = [direction] if isinstance(direction, str) else list(direction)
        self.directions = given * len(self.metrics) if len(given) == 1 else given
        self.bests: dict[str, float] = {}
        self.nonfinite = False
        self.metric_names: set[str] = set()  # what the evaluations reported
        self.evaluations = 0
        self.last: dict[str, float] = {}  # the last evaluation's metrics
        self.param_count: int | None = None

    @property
    def best(self) -> float | None:
        """The first metric's best value (the single objective's)."""
        return self.bests.get(self.metrics[0])

    def on_train_start(self, ctx: CallbackContext) -> None:
        model = getattr(ctx, "model", None)
        if model is not None and hasattr(model, "parameters"):
            self.param_count = sum(p.numel() for p in model.parameters())

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training or ctx.metrics is None:
            return
        self.evaluations += 1
        self.metric_names.update(ctx.metrics)
        numbers = {k: as_float(v) for k, v in ctx.metrics.items()}
        self.last = {k: v for k, v in numbers.items() if v is not None}
        for metric, direction in zip(self.metrics, self.directions, strict=True):
            value = self.measured(metric)
            if value is None or metric == PARAM_COUNT:
                continue
            if not math.isfinite(value):
                self.nonfinite = True
                continue
            best = self.bests.get(metric)
            if best is None or (value < best if direction == "minimize" else value > best):
                self.bests[metric] = value

    def measured(self, name: str) -> float | None:
        """``name`` in the last evaluation, or the model's parameter count for ``param_count``."""
        if name == PARAM_COUNT and name not in self.last:
            return None if self.param_count is None else float(self.param_count)
        return self.last.get(name)

    def objective(self, name: str) -> float | None:
        if name == PARAM_COUNT and name not in self.metric_names:
            return self.measured(name)
        return self.bests.get(name)

    def state_dict(self) -> dict[str, Any]:  # a resumed trial keeps its earlier evaluations
        return {
            "best": self.best,
            "bests": dict(self.bests),
            "nonfinite": self.nonfinite,
            "metric_names": sorted(self.metric_names),
            "evaluations": self.evaluations,
            "last": dict(self.last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bests = dict(state.get("bests", {}))
        if not self.bests and state.get("best") is not None:  # saved by one-metric tracking
            self.bests = {self.metrics[0]: state["best"]}
        self.nonfinite = bool(state.get("nonfinite", False))
        self.metric_names = set(state.get("metric_names", ()))
        self.evaluations = int(state.get("evaluations", 0))
        self.last = dict(state.get("last", {}))


class _Tee:
    """A text stream that writes to ``stream`` and to ``copy``."""

    def __init__(self, stream: Any, copy: Any) -> None:
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        self._copy.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._copy.flush()
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def tee_output(path: Path) -> Iterator[None]:
    """Copy what this process prints (stdout and stderr, from Python) to ``path`` too."""
    with open(path, "a", encoding="utf-8", buffering=1) as handle:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, handle), _Tee(err, handle)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


#: The stop reason of a trial stopped by :class:`HeldSignal`.
HELD_SIGNAL = "signal held by hookloop tune:"


class HeldSignal(Callback):
    """Stops the trial at the end of the step when a signal reached the study's handler
    rather than the Trainer's (it came while the trial was being set up, and the
    exception it raised was swallowed where it landed, e.g. in a finalizer)."""

    priority = 1

    def __init__(self, interrupts: Interrupts) -> None:
        self.interrupts = interrupts

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if self.interrupts.pending is not None:
            name = signal.Signals(self.interrupts.pending).name
            ctx.control.request_stop(f"{HELD_SIGNAL} {name}")


def train_trial(
    spec: TuneSpec,
    study_dir: Path,
    number: int,
    values: dict[str, Any],
    trial: Any = None,
    *,
    resume: bool = False,
    interrupts: Interrupts | None = None,
) -> tuple[Any, BestMetric]:
    """Train trial ``number`` with ``values`` in its run directory; every rank calls it.

    Rank 0 passes the Optuna ``trial`` (its pruner callback reports to it) and
    writes the run's ``config.yaml`` and ``params.yaml``; a prune is a stop
    request, which the loop agrees across ranks, so every rank stops at the same step.
    """
    from hookloop.callbacks.defaults import default_callbacks
    from hookloop.callbacks.optuna_pruning import OptunaPruning
    from hookloop.entry import build_trainer

    run_dir = trial_dir(study_dir, number)
    cfg = apply_params(copy.deepcopy(spec.base_config()), values).validate()
    if cfg.logging.wandb:  # W&B groups a study's trials (unless the caller chose a group)
        os.environ.setdefault("WANDB_RUN_GROUP", spec.study_name)
    best = BestMetric(spec.metric, spec.direction)
    callbacks = [*default_callbacks(cfg, run_dir), best]
    if interrupts is not None:
        callbacks.append(HeldSignal(interrupts))
    if trial is not None:
        run_dir.mkdir(parents=True, exist_ok=True)  # another rank may have made it
        RunDir(run_dir).config.write_text(dump_yaml(cfg.to_dict()))
        trial.set_user_attr("config", json.loads(json.dumps(cfg.to_dict(), default=str)))
        RunDir(run_dir).params.write_text(
            yaml.safe_dump({"study": spec.study_name, "trial": number, "params": values})
        )
        if not spec.multi_objective:  # Optuna cannot prune a multi-objective trial
            callbacks.append(OptunaPruning(trial, spec.metrics[0], raise_pruned=False))
    resume_from = "auto" if resume else None
    result = build_trainer(cfg, callbacks=callbacks, out_dir=run_dir, resume=resume_from).train()
    return result, best


def run_trial(
    spec: TuneSpec,
    study_dir: Path,
    trial: Any,
    values: dict[str, Any],
    interrupts: Interrupts | None = None,
) -> None:
    """Train one trial (see :func:`train_trial`) and tell the study how it ended.

    COMPLETE with the best value of each ``metric`` over its evaluations (``inf``, or
    ``-inf`` when maximising, for a run that went NaN or never produced a finite value,
    as the HPO trainer scores it); PRUNED when the pruner stopped it; FAIL with the
    error when training raised. The reason is the trial's ``fail_reason`` or
    ``prune_reason`` user attribute. With constraints, a COMPLETE or PRUNED trial
    records their values first (see :func:`record_constraints`).
    """
    from hookloop.callbacks.optuna_pruning import is_pruned_stop

    resume = take_over_run_dir(study_dir, trial)
    if resume:  # the pruner sees the evaluations before the interruption again
        for step, value in sorted(trial.user_attrs.get("reported", {}).items()):
            trial.report(value, int(step))
    run_dir = trial_dir(study_dir, trial.number)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with (
            interrupts.allowed() if interrupts is not None else contextlib.nullcontext(),
            tee_output(run_dir / CONSOLE_LOG),
        ):
            result, best = train_trial(
                spec, study_dir, trial.number, values, trial, resume=resume, interrupts=interrupts
            )
    except StudyInterrupted as stop:  # a signal while the trial was being set up
        interrupted(trial, f"interrupted by {signal.Signals(stop.signum).name} before training")
        raise
    except Exception as err:  # the trial failed; the study goes on
        trial.set_user_attr("traceback", traceback.format_exc()[-4000:])
        fail(trial, f"{type(err).__name__}: {err}")
        return
    signum = result.signal
    if signum is None and (result.stop_reason or "").startswith(HELD_SIGNAL):
        signum = interrupts.pending if interrupts is not None else None
    if signum is not None:  # a partial run: FAIL, to resume from its checkpoint later
        name = signal.Signals(signum).name
        interrupted(trial, f"interrupted by {name} at step {result.step}")
        raise StudyInterrupted(signum)
    if is_pruned_stop(result.stop_reason):
        trial.set_user_attr("prune_reason", result.stop_reason)
        record_constraints(spec, trial, best)
        trial.study.tell(trial, state=optuna().trial.TrialState.PRUNED)
        return
    score_trial(spec, trial, result, best)


def score_trial(spec: TuneSpec, trial: Any, result: Any, best: BestMetric) -> None:
    """Tell the study a trial that trained to its end: COMPLETE with its objective values,
    or FAIL when an objective or constraint metric was never reported (a setup error,
    said in one line, rather than a bad trial). A run that went NaN scores ``inf``."""
    from hookloop.callbacks.nan_detection import is_nonfinite_stop

    nonfinite = is_nonfinite_stop(result.stop_reason) or best.nonfinite
    missing = [m for m in spec.metrics if best.objective(m) is None]
    if missing and not nonfinite:
        fail(
            trial,
            f"--metric {missing[0]!r} is not among the evaluation metrics "
            f"{sorted(best.metric_names)} (or {PARAM_COUNT})"
            if best.evaluations
            else "no evaluation ran (set train.eval_every or train.eval_at_epoch_end)",
        )
        return
    absent = [c.text for c in spec.parsed_constraints() if best.measured(c.metric) is None]
    if absent and not nonfinite:
        fail(
            trial,
            f"--constraint {absent[0]!r} names a metric the evaluations do not report "
            f"(they report {', '.join(sorted(best.metric_names))}, and {PARAM_COUNT})",
        )
        return
    values = []
    for metric, direction in zip(spec.metrics, spec.directions, strict=True):
        value = best.objective(metric)
        if nonfinite or value is None or not math.isfinite(value):
            trial.set_user_attr("fail_reason", f"no finite {metric}: {result.stop_reason}")
            value = math.inf if direction == "minimize" else -math.inf
        values.append(value)
    record_constraints(spec, trial, best)
    trial.study.tell(trial, values=values if spec.multi_objective else values[0])


def fail(trial: Any, reason: str) -> None:
    """Record ``trial`` FAIL with ``reason`` (its ``fail_reason``); the study goes on."""
    trial.set_user_attr("fail_reason", reason)
    trial.study.tell(trial, state=optuna().trial.TrialState.FAIL)
    print(f"hookloop tune: trial {trial.number} failed: {reason}", file=sys.stderr)


def record_constraints(spec: TuneSpec, trial: Any, best: BestMetric) -> None:
    """Store the trial's constraint values as Optuna's samplers read them: the user attribute
    ``constraint`` (one value per constraint, feasible when all are <= 0; a sampler's
    ``constraints_func`` in Optuna < 5) and, where Optuna has it, ``trial.set_constraint``.
    A constraint whose metric was never measured (a trial pruned before it) counts as met,
    one measured as NaN as broken."""
    constraints = spec.parsed_constraints()
    if not constraints:
        return
    values = []
    for c in constraints:
        measured = best.measured(c.metric)
        if measured is None:
            values.append(0.0)
        else:  # a NaN run breaks every constraint
            values.append(math.inf if math.isnan(measured) else c.value(measured))
    trial.set_user_attr(CONSTRAINT_ATTR, values)
    if trials_set_constraints():
        for c, value in zip(constraints, values, strict=True):
            trial.set_constraint(c.text, value)


def interrupted(trial: Any, reason: str) -> None:
    """Record ``trial`` as cut short by a signal (FAIL, not counted) and queue it again
    (each write waits out a locked SQLite database: :func:`retry_locked`)."""
    study = trial.study
    retry_locked(lambda: trial.set_user_attr("fail_reason", reason))
    retry_locked(lambda: trial.set_user_attr("interrupted", True))
    retry_locked(lambda: study.tell(trial, state=optuna().trial.TrialState.FAIL))
    retry_locked(lambda: requeue(study, study.trials[trial.number]))
    print(f"hookloop tune: trial {trial.number} {reason}; it resumes on a restart", file=sys.stderr)
