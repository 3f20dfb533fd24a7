"""``hookloop tune``'s search controls: the sampler and pruner with their arguments, known
parameter sets tried first (``--enqueue``), a time budget (``--timeout``), and a console
log per trial."""

from __future__ import annotations

import pytest
import yaml

from hookloop.app.cli import main
from test_tune import FAST, _space_file

optuna = pytest.importorskip("optuna")

GRID = {
    "model.hidden": {"choices": [4, 8]},
    "optimizer.lr": {"low": 0.02, "high": 0.04, "step": 0.02},
}


def _tune(study, space, trials, *extra, fast=FAST):
    argv = ["tune", "--recipe", "mlp-regression", "--space", str(space), "--trials", str(trials)]
    return main([*argv, "--out", str(study), "--no-plots", *extra, *fast])


def _load(study):
    return optuna.load_study(study_name="hookloop", storage=f"sqlite:///{study / 'study.db'}")


def test_grid_sampler_enqueued_sets_first_and_a_console_log_per_trial(tmp_path):
    space = _space_file(tmp_path, GRID)
    known = tmp_path / "known.yaml"
    known.write_text(yaml.safe_dump([{"model.hidden": 8, "optimizer.lr": 0.04}]))
    study_dir = tmp_path / "grid"
    extra = ["--sampler", "grid", "--pruner", "none", "--enqueue", str(known)]
    talkative = [*FAST, "callbacks.info=true"]  # a run summary, printed at the start
    assert _tune(study_dir, space, 5, *extra, fast=talkative) == 0
    trials = _load(study_dir).trials
    assert trials[0].params == {"model.hidden": 8, "optimizer.lr": 0.04}  # enqueued first
    # then the grid's four points, each once (Optuna's grid does not count enqueued trials)
    assert sorted((t.params["model.hidden"], t.params["optimizer.lr"]) for t in trials[1:]) == [
        (4, 0.02), (4, 0.04), (8, 0.02), (8, 0.04),
    ]  # fmt: skip
    assert "run info:" in (study_dir / "trial-0000" / "console.log").read_text()
    spec = yaml.safe_load((study_dir / "tune.yaml").read_text())
    assert spec["sampler"] == "grid" and spec["pruner"] == "none"
    # a restart with the same --enqueue adds nothing twice
    assert _tune(study_dir, space, 5, *extra, fast=talkative) == 0
    assert len(_load(study_dir).trials) == 5


def test_timeout_starts_no_trial_after_it_and_the_study_continues_later(tmp_path, capsys):
    space = _space_file(tmp_path, GRID)
    study_dir = tmp_path / "timed"
    assert _tune(study_dir, space, 2, "--timeout", "0.001") == 0
    assert "--timeout 0.001 s reached with 0 of 2 trials done" in capsys.readouterr().err
    assert _load(study_dir).trials == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sampler", "anneal"], "--sampler must be one of tpe, random, grid, cmaes, qmc, gp"),
        (["--sampler-args", "[1, 2]"], "--sampler-args must be a YAML mapping"),
        (["--sampler", "random", "--sampler-args", "{bogus: 1}"], "--sampler-args: random"),
        (["--pruner", "threshold"], "--pruner-args: threshold (ThresholdPruner) refused {}"),
        (["--pruner-args", "{n_startup_trials: -1}"], "--pruner-args: median"),
        (["--timeout", "0"], "--timeout must be a number of seconds > 0, got 0.0"),
        (["--enqueue", "missing.yaml"], "--enqueue: file not found: missing.yaml"),
    ],
)
def test_bad_controls_are_one_line_usage_errors(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    space = _space_file(tmp_path, GRID)
    assert _tune(tmp_path / "s", space, 2, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "s").exists()


def test_bad_enqueue_entries_and_a_grid_over_a_float_range_name_what_is_wrong(tmp_path, capsys):
    space = _space_file(tmp_path, GRID)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {model.hiden: 8}\n")
    assert _tune(tmp_path / "a", space, 2, "--enqueue", str(bad)) == 2
    err = capsys.readouterr().err
    assert (
        "entry 0: 'model.hiden' is not a searched key; allowed: model.hidden, optimizer.lr" in err
    )
    bad.write_text("- {model.hidden: 0}\n")
    assert _tune(tmp_path / "b", space, 2, "--enqueue", str(bad)) == 2
    assert "entry 0: model.hidden must be an int >= 1, got 0" in capsys.readouterr().err
    floats = _space_file(tmp_path, {"optimizer.lr": {"low": 0.01, "high": 0.1}})
    assert _tune(tmp_path / "c", floats, 2, "--sampler", "grid") == 2
    assert "--sampler grid: optimizer.lr is a float range without a step" in capsys.readouterr().err
