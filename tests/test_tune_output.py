"""What ``hookloop tune`` prints: one line per trial with one worker as with two, the
trials' own output in their directories, and no Optuna log line unless ``--verbose``;
``hookloop.tune.run`` leaves Optuna's logging as its caller set it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hookloop.app.cli import main
from test_tune import FAST

optuna = pytest.importorskip("optuna")

SPACE = {"optimizer.lr": {"low": 1.0e-3, "high": 0.3, "log": True}}
#: FAST, with each trial's run info and progress table printed (as a user's trials do).
LOUD = [o for o in FAST if o not in ("logging.progress=false", "callbacks.info=false")]
TRIALS = 3


def _command(tmp_path: Path, study: Path, *extra: str) -> list[str]:
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    return ["tune", "--recipe", "mlp-regression", "--space", str(space), "--out", str(study),
            "--trials", str(TRIALS), "--no-plots", "--pruner", "none", *extra, *LOUD]  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2])
def test_a_study_prints_one_line_per_trial_whatever_the_workers(tmp_path, workers):
    study = tmp_path / "study"
    tune = [sys.executable, "-m", "hookloop", *_command(tmp_path, study, "--workers", str(workers))]
    done = subprocess.run(tune, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    err, out = done.stderr.splitlines(), done.stdout.splitlines()
    assert err[0] == f"hookloop tune: study hookloop in {study}"
    assert len(err) == 1 + TRIALS, done.stderr
    numbers = sorted(int(line.split()[3]) for line in err[1:])
    assert numbers == list(range(TRIALS))
    assert all(" complete value " in line for line in err[1:]), err
    # the best trials' table and where the best config is, as before
    assert out[0].split()[:2] == ["TRIAL", "VALUE"] and len(out) == 1 + TRIALS + 4, out
    assert "[I " not in done.stderr + done.stdout  # Optuna's INFO lines
    # each trial's whole output is in its directory, and in its worker's log
    logs = "".join(p.read_text() for p in (study / "workers").glob("worker-*.log"))
    for number in range(TRIALS):
        console = (study / f"trial-{number:04d}" / "console.log").read_text()
        assert "run info:" in console and "eval @ step 24" in console
    assert logs.count("run info:") == TRIALS
    if workers == 2:
        return
    plot = subprocess.run(
        [sys.executable, "-m", "hookloop", "plot", str(study)], capture_output=True, text=True
    )
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert "[I " not in plot.stderr + plot.stdout
    assert len(plot.stdout.splitlines()) == 3  # the three plots' paths


def test_verbose_shows_the_trials_output_and_optunas_log(tmp_path, capfd, caplog):
    before = optuna.logging.get_verbosity()
    with caplog.at_level(logging.INFO, logger="optuna"):
        assert main(_command(tmp_path, tmp_path / "study", "--verbose")) == 0
    assert capfd.readouterr().err.count("run info:") == TRIALS
    optuna_lines = [r.getMessage() for r in caplog.records if r.name.startswith("optuna")]
    assert any("A new study created" in line for line in optuna_lines), optuna_lines
    assert optuna.logging.get_verbosity() == before  # as it was before the command


def test_run_prints_a_line_per_trial_and_leaves_optunas_logging_alone(tmp_path, capfd):
    from hookloop.tune import run

    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # the caller's choice
    try:
        run("mlp-regression", SPACE, trials=2, out=tmp_path / "study", overrides=LOUD)
        assert optuna.logging.get_verbosity() == optuna.logging.ERROR
    finally:
        optuna.logging.set_verbosity(before)
    captured = capfd.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2 and all(" complete value " in line for line in lines), lines
    assert "run info:" not in captured.out + captured.err
