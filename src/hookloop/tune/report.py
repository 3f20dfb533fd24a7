"""What a finished study leaves behind: the best trials, the best config, and plots.

- ``best_trials.txt``: the best COMPLETE trials (value, parameters, run
  directory) and a count of trials by state, with the reasons of the failed ones; for
  several metrics, the Pareto front (``study.best_trials``: no other trial is at least as
  good on every metric and better on one);
- ``best_config.yaml``: the best trial's whole configuration, which
  ``hookloop train --config best_config.yaml`` trains again (same seed, same result); for
  several metrics, the Pareto trial best on the first metric, and ``pareto/trial-NNNN.yaml``
  for every trial of the front;
- ``plots/``: optimisation history, parameter importances and parallel
  coordinates, drawn by Optuna's own matplotlib visualisation; for several metrics the
  Pareto front instead (the others plot one objective).

A trial that breaks a constraint (``--constraint``) is never among the best.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from hookloop.tune.spec import (
    BEST_CONFIG_FILE,
    CONSTRAINT_ATTR,
    TuneSpec,
    constraint_values,
    feasible,
    optuna,
    trial_dir,
    trials_set_constraints,
)
from hookloop.tune.storage import open_study

#: Where the config of each trial on the Pareto front goes (several metrics).
PARETO_DIR = "pareto"

PLOTS = {
    "optimization_history": "plot_optimization_history",
    "param_importances": "plot_param_importances",
    "parallel_coordinate": "plot_parallel_coordinate",
}


def _multi(study: Any) -> bool:
    return len(study.directions) > 1


def best_trials(study: Any, n: int = 10) -> list[Any]:
    """The ``n`` best feasible COMPLETE trials with finite values, best first; for several
    metrics, the Pareto front (``study.best_trials``) ordered by the first metric."""
    if _multi(study):
        kept = _kept(study, feasible_only=True)
        front = [kept[t.number] for t in _copy_of(study, kept).best_trials]
        first = study.directions[0] == optuna().study.StudyDirection.MAXIMIZE
        return sorted(front, key=lambda t: ((-1 if first else 1) * t.values[0], t.number))[:n]
    state = optuna().trial.TrialState
    done = [
        t
        for t in study.get_trials(deepcopy=False, states=(state.COMPLETE,))
        if t.value is not None and math.isfinite(t.value) and feasible(t)
    ]
    reverse = study.direction == optuna().study.StudyDirection.MAXIMIZE
    return sorted(done, key=lambda t: (t.value, t.number), reverse=reverse)[:n]


def format_best(study: Any, study_dir: Path, n: int = 10) -> str:
    """An aligned table of the best trials (the Pareto front for several metrics), then the
    trials counted by state, the reasons of failed and pruned ones and the infeasible ones."""
    spec = TuneSpec.load(study_dir) if (study_dir / "tune.yaml").is_file() else None
    count = len(study.directions)
    metrics = spec.metrics if spec is not None else [f"value{i}" for i in range(count)]
    trials = best_trials(study, n if not _multi(study) else 10**9)
    keys = sorted({k for t in trials for k in t.params})
    value_names = [m.upper() for m in metrics] if _multi(study) else ["VALUE"]
    header = ["TRIAL", *value_names, *keys, "RUN"]
    rows = [header]
    for t in trials:
        params = [_fmt(t.params.get(k, "-")) for k in keys]
        values = [_fmt(v) for v in t.values]
        rows.append([str(t.number), *values, *params, trial_dir(study_dir, t.number).name])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    if _multi(study):
        count = f"{len(trials)} trial" + ("" if len(trials) == 1 else "s")
        lines.append(f"Pareto front ({count}): {_objectives(study, metrics)}")
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    all_trials = study.get_trials(deepcopy=False)
    by_state = Counter(t.state.name for t in all_trials)
    lines.append("")
    lines.append("trials: " + ", ".join(f"{by_state[s]} {s.lower()}" for s in sorted(by_state)))
    for t in all_trials:
        reason = t.user_attrs.get("fail_reason") or t.user_attrs.get("prune_reason")
        if t.state.name in ("FAIL", "PRUNED") and reason:
            lines.append(f"  trial {t.number} {t.state.name.lower()}: {reason}")
    constraints = spec.parsed_constraints() if spec is not None else []
    for t in all_trials:
        if t.state.name == "COMPLETE" and not feasible(t):
            broken = [
                f"{c.text} ({c.metric} off by {v:.6g})"
                for c, v in zip(constraints, t.user_attrs["constraint"], strict=False)
                if v > 0
            ]
            lines.append(f"  trial {t.number} infeasible: breaks {'; '.join(broken)}")
    return "\n".join(lines)


def _objectives(study: Any, metrics: list[str]) -> str:
    return ", ".join(
        f"{m} ({d.name.lower()})" for m, d in zip(metrics, study.directions, strict=False)
    )


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_best_config(study: Any, study_dir: Path) -> Path | None:
    """Write the best trial's whole config to ``best_config.yaml``; None if no trial finished.

    With several metrics, ``best_config.yaml`` is the Pareto trial best on the first metric,
    and ``pareto/trial-NNNN.yaml`` holds the config of every trial on the front (the folder
    is written afresh each time). From the storage alone: the trial's ``config`` user
    attribute (the best trial may have run on another machine); else its run directory's
    ``config.yaml``; else the study's recipe and overrides with the trial's parameters.
    """
    trials = best_trials(study, 1 if not _multi(study) else 10**9)
    if _multi(study):
        folder = study_dir / PARETO_DIR
        shutil.rmtree(folder, ignore_errors=True)
        if trials:
            folder.mkdir()
        for t in trials:
            _write_config(t, study_dir, folder / f"trial-{t.number:04d}.yaml")
    if not trials:
        return None
    target = study_dir / BEST_CONFIG_FILE
    _write_config(trials[0], study_dir, target)
    return target


def _write_config(trial: Any, study_dir: Path, target: Path) -> None:
    from hookloop.config import dump_yaml
    from hookloop.tune.space import apply_params

    local = trial_dir(study_dir, trial.number) / "config.yaml"
    if isinstance(trial.user_attrs.get("config"), dict):
        target.write_text(dump_yaml(trial.user_attrs["config"]))
    elif local.is_file():
        shutil.copyfile(local, target)
    else:
        spec = TuneSpec.load(study_dir)
        cfg = apply_params(spec.base_config(), trial.params).validate()
        target.write_text(dump_yaml(cfg.to_dict()))


def write_plots(study: Any, out_dir: Path, study_dir: Path | None = None) -> list[Path]:
    """Draw the study's plots as PNGs under ``out_dir``; a plot Optuna cannot draw yet is skipped.

    Trials scored ``inf`` (NaN runs) are left out of the plots, which need finite values.
    With several metrics the plot is the Pareto front (named by ``study_dir``'s metrics).
    """
    require_plot = optuna().visualization.matplotlib
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    finite = _finite_study(study)
    plots: dict[str, Any] = {name: getattr(require_plot, f) for name, f in PLOTS.items()}
    if _multi(study):  # the others plot one objective
        plots = {"pareto_front": lambda s: _pareto_plot(s, study_dir=study_dir)}
    for name, function in plots.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
            try:
                axes = function(finite)
            except (ValueError, RuntimeError) as err:
                warnings.warn(f"hookloop tune: {name} plot skipped: {err}", stacklevel=2)
                continue
        figure = _figure(axes)
        figure.set_size_inches(9, 6)
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


def _figure(axes: Any) -> Any:
    first = axes.flat[0] if hasattr(axes, "flat") else axes
    return first.figure


def _pareto_plot(study: Any, *, study_dir: Path | None) -> Any:
    """Optuna's Pareto-front plot: 2 or 3 metrics, axes named after them."""
    if len(study.directions) > 3:
        raise ValueError(f"a Pareto-front plot shows 2 or 3 metrics, not {len(study.directions)}")
    names = None
    if study_dir is not None and (study_dir / "tune.yaml").is_file():
        names = TuneSpec.load(study_dir).metrics
    kwargs: dict[str, Any] = {"target_names": names}
    if not trials_set_constraints() and any(CONSTRAINT_ATTR in t.user_attrs for t in study.trials):
        kwargs["constraints_func"] = constraint_values  # Optuna < 5: infeasible greyed out
    return optuna().visualization.matplotlib.plot_pareto_front(study, **kwargs)


def _finite_study(study: Any) -> Any:
    """An in-memory copy of the study without trials whose values are not finite."""
    return _copy_of(study, _kept(study))


def _kept(study: Any, *, feasible_only: bool = False) -> list[Any]:
    """The finished trials with finite values (and, with ``feasible_only``, without those
    that break a constraint), in order."""
    opt = optuna()
    kept = []
    for t in study.get_trials(deepcopy=True):
        done = t.state == opt.trial.TrialState.COMPLETE
        if done and not all(math.isfinite(v) for v in t.values):
            continue
        if t.state in (opt.trial.TrialState.RUNNING, opt.trial.TrialState.WAITING):
            continue
        if feasible_only and not feasible(t):
            continue
        kept.append(t)
    return kept


def _copy_of(study: Any, trials: list[Any]) -> Any:
    """An in-memory study of ``trials``; its trial ``i`` is ``trials[i]``."""
    logging = optuna().logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.WARNING)  # not "A new study created in memory" each time
    try:
        copy = optuna().create_study(directions=study.directions)
    finally:
        logging.set_verbosity(verbosity)
    copy.add_trials(trials)
    return copy


def finish(study_dir: Path, *, plots: bool = True, echo: bool = True) -> dict[str, Any]:
    """Write ``best_trials.txt``, ``best_config.yaml`` and the plots; print the table."""
    spec = TuneSpec.load(study_dir)
    study = open_study(spec, study_dir)
    table = format_best(study, study_dir)
    (study_dir / "best_trials.txt").write_text(table + "\n")
    best = write_best_config(study, study_dir)
    written = write_plots(study, study_dir / "plots", study_dir) if plots else []
    if echo:
        print(table)
        if best is not None:
            print(f"\nbest config: {best}  (hookloop train --config {best})")
        for path in written:
            print(f"plot: {path}")
    return {"table": table, "best_config": best, "plots": written}


def plot_study(study_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """``hookloop plot STUDY_DIR``: the study's plots, under ``out`` (default: STUDY_DIR/plots)."""
    study_dir = Path(study_dir)
    study = open_study(TuneSpec.load(study_dir), study_dir, existing=True)
    return write_plots(study, Path(out) if out is not None else study_dir / "plots", study_dir)
