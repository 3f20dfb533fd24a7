"""``hookloop.tune.run``: a study from Python, of a recipe or of your own objective.

``run("mlp-regression", space, trials=20, out="runs/s")`` is ``hookloop tune`` (the same
study directory, restartable, ``workers`` processes). ``run(objective, trials=20,
out="runs/s")`` runs a function ``objective(trial) -> float`` on a real Optuna storage
with the same guarantees: exactly ``trials`` COMPLETE or PRUNED trials however often it
is restarted, a failing trial recorded FAIL with its reason, and Ctrl-C recording the cut
trial FAIL (interrupted) and queuing its parameters for the next run.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hookloop.tune.claims import counts, host_name, recover_interrupted, requeue, study_lock
from hookloop.tune.space import SearchSpace
from hookloop.tune.spec import DB_FILE, DIRECTIONS, TuneError, TuneSpec, make_pruner, optuna
from hookloop.tune.storage import open_study


def run(
    target: str | Callable[[Any], float],
    space: Mapping[str, Any] | str | Path | None = None,
    *,
    trials: int,
    out: str | Path,
    workers: int = 1,
    metric: str | list[str] = "eval_loss",
    direction: str | list[str] = "minimize",
    storage: str | None = None,
    study_name: str = "hookloop",
    seed: int = 0,
    pruner: str | None = None,
    sampler: str = "tpe",
    sampler_args: Mapping[str, Any] | None = None,
    constraints: list[str] | tuple[str, ...] = (),
    overrides: list[str] | tuple[str, ...] = (),
    plots: bool = False,
) -> Any:
    """Run (or continue) a study and return it as an ``optuna.Study``.

    ``target`` is a recipe (a name, or ``package.module:object``; ``space``, a mapping or
    a YAML file, is then required) or a function ``objective(trial) -> float``. The
    keywords are ``hookloop tune``'s options: docs/tune.md ("From Python") says what
    each does. Raises ``ValueError`` for bad arguments and :class:`TuneError` when
    every trial fails.
    """
    objective = callable(target) and not isinstance(target, str)
    if pruner is None:  # median; none for several objectives (Optuna cannot prune those)
        several = not isinstance(_one_or_list(direction if objective else metric), str)
        pruner = "none" if several else "median"
    if isinstance(space, (str, Path)):
        from hookloop.tune.cli import read_space

        space = read_space(str(space))
    if objective:
        if constraints:
            raise ValueError(
                "constraints= name a recipe's metrics; an objective function records its "
                "own with trial.set_constraint(name, value) (Optuna >= 5)"
            )
        return _run_objective(
            target, space, trials=trials, out=Path(out), direction=direction,
            storage=storage, study_name=study_name, seed=seed, pruner=pruner,
        )  # fmt: skip
    spec = _recipe_spec(
        target, space, trials=trials, overrides=list(overrides), metric=_one_or_list(metric),
        direction=_one_or_list(direction), storage=storage, study_name=study_name, seed=seed,
        pruner=pruner, sampler=sampler, sampler_args=dict(sampler_args or {}),
        constraints=list(constraints),
    )  # fmt: skip
    return _run_recipe(spec, Path(out), workers=workers, plots=plots)


def _recipe_spec(target: Any, space: Mapping[str, Any] | None, **options: Any) -> TuneSpec:
    """The study ``hookloop tune`` would run for recipe ``target`` with these options."""
    if not isinstance(target, str):
        raise ValueError(
            f"target must be a recipe name, package.module:object, or a callable "
            f"objective(trial), got {type(target).__name__}"
        )
    if space is None:
        raise ValueError("space is required to tune a recipe (config keys to ranges)")
    return TuneSpec(recipe=target, space=dict(space), **options)


def _one_or_list(value: Any) -> Any:
    """A list of one (``metric=["eval_loss"]``) is that one: the study is single-objective."""
    return (
        value[0]
        if isinstance(value, (list, tuple)) and len(value) == 1
        else (list(value) if isinstance(value, tuple) else value)
    )


def _run_recipe(spec: TuneSpec, study_dir: Path, *, workers: int, plots: bool) -> Any:
    from hookloop.tune.cli import prepare, run_here, run_workers
    from hookloop.tune.report import finish

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    spec.validate()
    prepare(spec, study_dir)
    if workers == 1:
        run_here(study_dir)
    else:
        run_workers(study_dir, workers)
    finish(study_dir, plots=plots, echo=False)
    return open_study(TuneSpec.load(study_dir), study_dir)


def _run_objective(
    objective: Callable[[Any], float],
    space: Mapping[str, Any] | None,
    *,
    trials: int,
    out: Path,
    direction: str | list[str],
    storage: str | None,
    study_name: str,
    seed: int,
    pruner: str,
) -> Any:
    """Claim, run and record trials of ``objective`` until the study has ``trials``
    COMPLETE or PRUNED ones (``hookloop tune``'s rules, on a plain function)."""
    directions = _objective_directions(trials, direction, pruner)
    drawn = SearchSpace(space) if space is not None else None
    opt = optuna()
    out.mkdir(parents=True, exist_ok=True)
    # The storage object is kept: recovering an interrupted trial writes through it.
    rdb_storage = opt.storages.RDBStorage(storage or f"sqlite:///{(out / DB_FILE).resolve()}")
    study = opt.create_study(
        storage=rdb_storage,
        study_name=study_name,
        directions=directions,
        sampler=opt.samplers.TPESampler(seed=seed + len(_trials_in(out, storage, study_name))),
        pruner=make_pruner(pruner),
        load_if_exists=True,
    )
    while True:
        with study_lock(out):
            recover_interrupted(study, rdb_storage)
            now = counts(study)
            if now.done >= trials:
                return study
            if now.failed >= trials:
                raise TuneError(f"{now.failed} trials failed (the limit is {trials})")
            trial = study.ask()
            trial.set_user_attr("pid", os.getpid())
            trial.set_user_attr("host", host_name())
            if drawn is not None:
                drawn.suggest(trial)
        _run_objective_trial(objective, study, trial, len(directions))


def _objective_directions(trials: Any, direction: Any, pruner: str) -> list[str]:
    """``direction`` as a list (one per objective), once ``trials``, it and ``pruner`` are
    checked; each bad argument is one ``ValueError``."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    directions = [direction] if isinstance(direction, str) else list(direction)
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(
            f"direction must be 'minimize' or 'maximize', or a list of them (one per "
            f"objective), got {direction!r}"
        )
    if len(directions) > 1 and pruner != "none":
        raise ValueError(
            f"pruner {pruner!r} cannot be used with several objectives (Optuna cannot prune "
            "a multi-objective trial); give pruner='none'"
        )
    return directions


def _run_objective_trial(
    objective: Callable[[Any], float], study: Any, trial: Any, objectives: int
) -> None:
    """Call ``objective`` on a claimed trial and tell the study how it ended: COMPLETE,
    PRUNED (``optuna.TrialPruned``), or FAIL with the reason (an exception, or a value
    that is not ``objectives`` numbers). Ctrl-C fails the trial, queues it again and
    goes up to the caller."""
    state = optuna().trial.TrialState
    try:
        value = objective(trial)
    except optuna().TrialPruned as err:
        trial.set_user_attr("prune_reason", str(err) or "pruned")
        study.tell(trial, state=state.PRUNED)
        return
    except KeyboardInterrupt:
        trial.set_user_attr("fail_reason", "interrupted by SIGINT")
        trial.set_user_attr("interrupted", True)
        study.tell(trial, state=state.FAIL)
        requeue(study, study.trials[trial.number])
        raise
    except Exception as err:  # the trial failed; the study goes on
        trial.set_user_attr("fail_reason", f"{type(err).__name__}: {err}")
        trial.set_user_attr("traceback", traceback.format_exc()[-4000:])
        study.tell(trial, state=state.FAIL)
        print(f"hookloop tune: trial {trial.number} failed: {err}", file=sys.stderr)
        return
    numbers = _numbers(value, objectives)
    if numbers is None:
        wanted = "a number" if objectives == 1 else f"{objectives} numbers"
        trial.set_user_attr("fail_reason", f"the objective returned {value!r}, not {wanted}")
        study.tell(trial, state=state.FAIL)
        return
    study.tell(trial, numbers if objectives > 1 else numbers[0])


def _numbers(value: Any, count: int) -> list[float] | None:
    """The objective's return value as ``count`` floats, or None if it is not that."""
    values = list(value) if count > 1 and isinstance(value, (list, tuple)) else [value]
    if len(values) != count:
        return None
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        return None
    return None if any(math.isnan(n) for n in numbers) else numbers


def _trials_in(out: Path, storage: str | None, study_name: str) -> list[Any]:
    """The trials already in the study (the sampler's seed moves on with each restart)."""
    if storage is None and not (out / DB_FILE).is_file():
        return []
    try:
        url = storage or f"sqlite:///{(out / DB_FILE).resolve()}"
        return optuna().load_study(study_name=study_name, storage=url).trials
    except KeyError:  # no such study yet
        return []
