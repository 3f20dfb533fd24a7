"""``Trainer.hyperparameter_search(backend="optuna")`` as transformers runs it.

Each trial sets the values ``hp_space(trial)`` returns on the trainer's arguments
(cast to the type the argument had, as transformers casts them; a name that is no
argument is warned about and left out), builds a fresh trainer of the same class
from ``model_init`` and the same datasets, callbacks and functions, and trains it.
Every evaluation during training reports ``compute_objective(metrics)`` to the trial
at the step it ran (a trial the pruner stops raises ``optuna.TrialPruned``); without
one, the trial evaluates once at the end. The study is Optuna's own
(``optuna.create_study(direction=..., **kwargs)`` with ``timeout``, ``n_jobs``,
``gc_after_trial`` and ``catch`` taken out for ``optimize``), so ``storage=``,
``study_name=``, ``sampler=`` and ``pruner=`` are Optuna's.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

from hookloop.callback import Callback
from hookloop.state import CallbackContext

log = logging.getLogger(__name__)


class BestRun(NamedTuple):
    """transformers' ``BestRun``: the best trial's number (a string), its objective and
    hyperparameters."""

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any = None


def default_compute_objective(metrics: dict[str, float]) -> float:
    """The evaluation loss when that is the only metric, else the sum of the metrics
    (the epoch and the speed keys left out), as transformers computes it."""
    metrics = copy.deepcopy(metrics)
    loss = metrics.pop("eval_loss", None)
    metrics.pop("epoch", None)
    for key in [k for k in metrics if k.endswith(("_runtime", "_per_second"))]:
        metrics.pop(key)
    return loss if not metrics else sum(metrics.values())  # type: ignore[return-value]  # as transformers: None without eval_loss


def default_hp_space_optuna(trial: Any) -> dict[str, Any]:
    """transformers' default search space for Optuna."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-4, log=True),
        "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 5),
        "seed": trial.suggest_int("seed", 1, 40),
        "per_device_train_batch_size": trial.suggest_categorical(
            "per_device_train_batch_size", [4, 8, 16, 32, 64]
        ),
    }


def apply_params(args: Any, params: dict[str, Any]) -> None:
    """Set a trial's values on ``args``, cast to each argument's type (transformers' rule)."""
    for key, value in params.items():
        if not hasattr(args, key):
            log.warning("hyperparameter search: %r is no TrainingArguments field; left out", key)
            continue
        old = getattr(args, key)
        setattr(args, key, type(old)(value) if old is not None else value)


class ReportObjective(Callback):
    """Reports each evaluation's objective in training to the trial; prunes on request."""

    def __init__(self, trainer: Any, trial: Any, compute_objective: Callable[..., float]):
        self.trainer, self.trial, self.compute_objective = trainer, trial, compute_objective

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training or ctx.metrics is None:
            return
        objective = self.compute_objective(dict(ctx.metrics))
        self.trainer.objective = objective
        study = getattr(self.trial, "study", None)
        if study is None or len(study.directions) > 1:
            return  # as transformers: a multi-objective trial reports nothing and is not pruned
        self.trial.report(objective, ctx.state.step)
        if self.trial.should_prune():
            import optuna

            raise optuna.TrialPruned()


def run_optuna(
    build: Callable[[Any], Any],
    args: Any,
    *,
    hp_space: Callable[[Any], dict[str, Any]],
    compute_objective: Callable[[dict[str, float]], float],
    hp_name: Callable[[Any], str] | None,
    n_trials: int,
    direction: str | list[str],
    kwargs: dict[str, Any],
) -> tuple[BestRun | list[BestRun], Any]:
    """The study (see the module doc). ``build(trial)`` makes a trial's trainer from
    ``args`` as the trial has set them (its checkpoints in ``output_dir/run-N``).
    Returns the best run(s) and the last trial's trainer."""
    import optuna

    trainers: list[Any] = []

    def objective(trial: Any) -> float:
        apply_params(args, hp_space(trial))
        trainer = build(trial)
        trainers[:] = [trainer]
        trainer.objective = None
        trainer.state.is_hyper_param_search = True
        trainer.state.trial_params = dict(trial.params)
        trainer.state.trial_name = hp_name(trial) if hp_name is not None else None
        trainer.callbacks.add(ReportObjective(trainer, trial, compute_objective))
        trainer.train()
        if trainer.objective is None:  # no evaluation during training
            trainer.objective = compute_objective(trainer.evaluate())
        return trainer.objective

    options = dict(kwargs)
    run = {key: options.pop(key) for key in ("timeout", "n_jobs", "gc_after_trial", "catch")
           if key in options}  # fmt: skip
    several = isinstance(direction, list)
    study = optuna.create_study(
        direction=None if several else direction,
        directions=direction if several else None,
        **options,
    )
    study.optimize(objective, n_trials=n_trials, **run)
    last = trainers[0] if trainers else None
    if len(study.directions) == 1:
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params), last
    return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials], last


def hyperparameter_search(
    trainer: Any,
    *,
    hp_space: Callable[[Any], dict[str, Any]] | None,
    compute_objective: Callable[[dict[str, float]], float] | None,
    n_trials: int,
    direction: str | list[str],
    backend: Any,
    hp_name: Callable[[Any], str] | None,
    kwargs: dict[str, Any],
) -> BestRun | list[BestRun]:
    """``trainer.hyperparameter_search(...)``: a fresh trainer of the same class for each
    trial (a fresh optimizer too, as transformers builds it, and checkpoints in its own
    run directory); afterwards ``trainer`` holds the last trial's model and state."""
    backend = getattr(backend, "value", backend)
    if backend not in (None, "optuna"):
        raise ValueError(
            f"hyperparameter_search backend {backend!r} is not supported by "
            "hookloop.compat.hf.Trainer; allowed: 'optuna'"
        )
    if trainer.model_init is None:
        raise RuntimeError(
            "hyperparameter_search needs the model through model_init (a function "
            "returning a fresh one for each trial)"
        )
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ValueError(f"n_trials must be an int >= 1, got {n_trials!r}")

    def build(trial: Any) -> Any:
        args = copy.copy(trainer.args)  # the trial's values (batch size too) are on its args
        run = hp_name(trial) if hp_name is not None else f"run-{trial.number}"
        args.output_dir = os.path.join(trainer.args.output_dir, run)  # transformers' run dir
        given = {**trainer.given, "args": args, "optimizers": (None, None)}
        preprocess = trainer.preprocess_logits_for_metrics
        return type(trainer)(None, **given, preprocess_logits_for_metrics=preprocess)

    best, last = run_optuna(
        build,
        trainer.args,
        hp_space=hp_space or default_hp_space_optuna,
        compute_objective=compute_objective or default_compute_objective,
        hp_name=hp_name,
        n_trials=n_trials,
        direction=direction,
        kwargs=kwargs,
    )
    if last is not None:  # as transformers: the trainer holds the last trial's run
        trainer.model.load_state_dict(last.model.state_dict())
        trainer.hf.state = last.state
        if trainer.args_built is not None:  # and trains on with the last trial's batch size
            batch = trainer.args.per_device_train_batch_size
            trainer.args_built["per_device_train_batch_size"] = batch
    return best
