"""What a finished study leaves behind: the best trials, the best config, and plots.

- ``best_trials.txt``: the best COMPLETE trials (value, parameters, run
  directory) and a count of trials by state, with the reasons of the failed ones;
- ``best_config.yaml``: the best trial's whole configuration, which
  ``hookloop train --config best_config.yaml`` trains again (same seed, same result);
- ``plots/``: optimisation history, parameter importances and parallel
  coordinates, drawn by Optuna's own matplotlib visualisation.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from hookloop.tune.study import BEST_CONFIG_FILE, TuneSpec, open_study, optuna, trial_dir

PLOTS = {
    "optimization_history": "plot_optimization_history",
    "param_importances": "plot_param_importances",
    "parallel_coordinate": "plot_parallel_coordinate",
}


def best_trials(study: Any, n: int = 10) -> list[Any]:
    """The ``n`` best COMPLETE trials with a finite value, best first."""
    state = optuna().trial.TrialState
    done = [
        t
        for t in study.get_trials(deepcopy=False, states=(state.COMPLETE,))
        if t.value is not None and math.isfinite(t.value)
    ]
    reverse = study.direction == optuna().study.StudyDirection.MAXIMIZE
    return sorted(done, key=lambda t: (t.value, t.number), reverse=reverse)[:n]


def format_best(study: Any, study_dir: Path, n: int = 10) -> str:
    """An aligned table of the best trials, then the trials counted by state."""
    trials = best_trials(study, n)
    keys = sorted({k for t in trials for k in t.params})
    header = ["TRIAL", "VALUE", *keys, "RUN"]
    rows = [header]
    for t in trials:
        params = [_fmt(t.params.get(k, "-")) for k in keys]
        rows.append([str(t.number), _fmt(t.value), *params, trial_dir(study_dir, t.number).name])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    all_trials = study.get_trials(deepcopy=False)
    by_state = Counter(t.state.name for t in all_trials)
    lines.append("")
    lines.append("trials: " + ", ".join(f"{by_state[s]} {s.lower()}" for s in sorted(by_state)))
    for t in all_trials:
        reason = t.user_attrs.get("fail_reason") or t.user_attrs.get("prune_reason")
        if t.state.name in ("FAIL", "PRUNED") and reason:
            lines.append(f"  trial {t.number} {t.state.name.lower()}: {reason}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_best_config(study: Any, study_dir: Path) -> Path | None:
    """Write the best trial's whole config to ``best_config.yaml``; None if no trial finished.

    From the storage alone: the trial's ``config`` user attribute (the best trial may have
    run on another machine); else its run directory's ``config.yaml``; else the study's
    recipe and overrides with the trial's parameters.
    """
    from hookloop.config import dump_yaml
    from hookloop.tune.space import apply_params

    trials = best_trials(study, 1)
    if not trials:
        return None
    best = trials[0]
    target = study_dir / BEST_CONFIG_FILE
    local = trial_dir(study_dir, best.number) / "config.yaml"
    if isinstance(best.user_attrs.get("config"), dict):
        target.write_text(dump_yaml(best.user_attrs["config"]))
    elif local.is_file():
        shutil.copyfile(local, target)
    else:
        spec = TuneSpec.load(study_dir)
        cfg = apply_params(spec.base_config(), best.params).validate()
        target.write_text(dump_yaml(cfg.to_dict()))
    return target


def write_plots(study: Any, out_dir: Path) -> list[Path]:
    """Draw the study's plots as PNGs under ``out_dir``; a plot Optuna cannot draw yet is skipped.

    Trials scored ``inf`` (NaN runs) are left out of the plots, which need finite values.
    """
    require_plot = optuna().visualization.matplotlib
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    finite = _finite_study(study)
    for name, function in PLOTS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
            try:
                axes = getattr(require_plot, function)(finite)
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


def _finite_study(study: Any) -> Any:
    """An in-memory copy of the study without trials whose value is not finite."""
    opt = optuna()
    copy = opt.create_study(direction=study.direction)
    for t in study.get_trials(deepcopy=True):
        if t.state == opt.trial.TrialState.COMPLETE and not math.isfinite(t.value):
            continue
        if t.state in (opt.trial.TrialState.RUNNING, opt.trial.TrialState.WAITING):
            continue
        copy.add_trial(t)
    return copy


def finish(study_dir: Path, *, plots: bool = True, echo: bool = True) -> dict[str, Any]:
    """Write ``best_trials.txt``, ``best_config.yaml`` and the plots; print the table."""
    spec = TuneSpec.load(study_dir)
    study = open_study(spec, study_dir)
    table = format_best(study, study_dir)
    (study_dir / "best_trials.txt").write_text(table + "\n")
    best = write_best_config(study, study_dir)
    written = write_plots(study, study_dir / "plots") if plots else []
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
    study = open_study(TuneSpec.load(study_dir), study_dir)
    return write_plots(study, Path(out) if out is not None else study_dir / "plots")
