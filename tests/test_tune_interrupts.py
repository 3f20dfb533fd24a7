"""``hookloop tune`` stopped by SIGINT / SIGTERM: the trial it cut is FAIL (never COMPLETE with
a partial score), and the same command again resumes that trial from its own checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _quiet import SERVICES_OFF
from hookloop.app.cli import main
from hookloop.callback import Callback
from hookloop.recipes import Recipe, mlp
from test_tune import FAST

optuna = pytest.importorskip("optuna")

SPACE = {"optimizer.lr": {"low": 1.0e-3, "high": 0.3, "log": True}}


class SignalAt(Callback):
    """Sends this process ``signum`` once, at optimizer step ``step`` of the first run."""

    sent = False

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step and not SignalAt.sent:
            SignalAt.sent = True
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def signalling_recipe(monkeypatch):
    from hookloop import recipes

    recipes._load_builtin()

    def build(cfg):
        parts = mlp.build(cfg)
        parts.callbacks.append(SignalAt(12, signal.SIGINT))
        return parts

    SignalAt.sent = False
    monkeypatch.setitem(
        recipes._RECIPES,
        "mlp-signal",
        Recipe("mlp-signal", "mlp-regression; SIGINT at step 12 once", mlp.default_config, build),
    )


def _states(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT number, state FROM trials ORDER BY number").fetchall()


def test_ctrl_c_fails_the_cut_trial_and_a_restart_resumes_it_from_its_checkpoint(
    tmp_path, capsys, signalling_recipe
):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    study_dir = tmp_path / "study"
    argv = ["tune", "--recipe", "mlp-signal", "--space", str(space), "--trials", "2"]
    argv += ["--out", str(study_dir), "--no-plots", "--pruner", "none", *FAST]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "trial 0 interrupted by SIGINT at step 12" in err
    assert "stopped by SIGINT; the same command continues the study" in err
    db = study_dir / "study.db"
    assert _states(db) == [(0, "FAIL"), (1, "WAITING")]  # cut, and queued again
    assert (study_dir / "trial-0000" / "checkpoints").is_dir()

    assert main(argv) == 0
    loaded = optuna.load_study(study_name="hookloop", storage=f"sqlite:///{db}")
    states = [(t.number, t.state.name) for t in loaded.trials]
    assert states == [(0, "FAIL"), (1, "COMPLETE"), (2, "COMPLETE")]
    cut, retry = loaded.trials[0], loaded.trials[1]
    assert cut.user_attrs["interrupted"] is True and cut.value is None
    assert retry.user_attrs["retry_of"] == 0 and retry.params == cut.params
    # the retry went on from the cut trial's step-12 checkpoint, in its own directory
    assert not (study_dir / "trial-0000").exists()
    records = [
        json.loads(line)
        for line in (study_dir / "trial-0001" / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [8, 16, 24]  # step 8's from before the cut, kept
    assert retry.value == min(r["eval_loss"] for r in evals)  # the objective counts it too
    assert sorted(retry.intermediate_values) == [8, 16, 24]


@pytest.mark.slow
def test_sigterm_to_a_driver_with_two_workers_fails_and_requeues_both_trials(
    tmp_path,
):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    study_dir = tmp_path / "study"
    db = study_dir / "study.db"
    command = [
        sys.executable, "-m", "hookloop", "tune", "--recipe", "mlp-regression",
        "--space", str(space), "--trials", "6", "--workers", "2", "--out", str(study_dir),
        "--no-plots", "--pruner", "none", *FAST, *SERVICES_OFF, "train.max_steps=100000",
    ]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while True:  # both workers inside a trial far longer than the test
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
                running = conn.execute(
                    "SELECT COUNT(*) FROM trials WHERE state = 'RUNNING'"
                ).fetchone()[0]
        except sqlite3.OperationalError:
            running = 0
        if running == 2:
            break
        assert driver.poll() is None, driver.stderr.read().decode()
        assert time.monotonic() < deadline, "the workers never started a trial"
        time.sleep(0.05)
    driver.send_signal(signal.SIGTERM)
    # Alone the workers stop, record their trials and exit within ~1 s of the signal; on
    # a loaded 2-core machine (8 such studies at once) it took 20-28 s, and one suite run
    # passed 60 s. The bound only keeps a real hang from stalling the suite.
    _, err = driver.communicate(timeout=300)
    assert driver.returncode == 143, err.decode()
    assert "stopped by SIGTERM" in err.decode()
    loaded = optuna.load_study(study_name="hookloop", storage=f"sqlite:///{db}")
    states = [t.state.name for t in loaded.trials]
    assert "RUNNING" not in states and "COMPLETE" not in states, states
    cut = [t for t in loaded.trials if t.state.name == "FAIL"]
    assert len(cut) == 2 and states.count("WAITING") == 2, states  # both cut, queued again
    for trial in cut:
        assert trial.user_attrs["fail_reason"].startswith("interrupted by SIGTERM")
    # the two workers shared the cores instead of each using all of them
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for index in range(2):
        log = (study_dir / "workers" / f"worker-{index}.log").read_text()
        assert f"worker {index}: {threads} CPU threads" in log, log


def test_a_signal_whose_exception_was_swallowed_still_stops_the_trial(tmp_path, monkeypatch):
    """A signal that lands while a trial is being set up raises in whatever code runs then;
    code that swallows it (a finalizer does) cannot keep the trial training to the end."""
    from hookloop import recipes
    from hookloop.tune.study import StudyInterrupted

    recipes._load_builtin()

    def build(cfg):
        with contextlib.suppress(StudyInterrupted):  # swallowed
            os.kill(os.getpid(), signal.SIGTERM)
        return mlp.build(cfg)

    monkeypatch.setitem(
        recipes._RECIPES,
        "mlp-swallow",
        Recipe("mlp-swallow", "mlp-regression; SIGTERM during build", mlp.default_config, build),
    )
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    study_dir = tmp_path / "study"
    argv = ["tune", "--recipe", "mlp-swallow", "--space", str(space), "--trials", "2"]
    assert main([*argv, "--out", str(study_dir), "--no-plots", "--pruner", "none", *FAST]) == 143
    trial = optuna.load_study(
        study_name="hookloop", storage=f"sqlite:///{study_dir / 'study.db'}"
    ).trials[0]
    assert trial.state.name == "FAIL"
    assert trial.user_attrs["fail_reason"] == "interrupted by SIGTERM at step 1"


#: `hookloop tune` with a SIGTERM sent to itself, as `kill` from elsewhere would, at one
#: moment of the command (argv[1]): while the recipe and Optuna load and the command is
#: checked (validate), while the study is being created (prepare), or once the trials
#: are done, while the results and plots are written (finish).
SIGTERM_AT = """
import os, signal, sys
from hookloop.app.cli import main
from hookloop.tune import cli, report, study

where = sys.argv[1]
owner = {"validate": study.TuneSpec, "prepare": cli, "finish": report}[where]
real = getattr(owner, where)

def with_sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)

setattr(owner, where, with_sigterm)
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("where", ["validate", "prepare", "finish"])
def test_sigterm_anywhere_in_the_command_exits_143_with_a_word(tmp_path, where):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    study_dir = tmp_path / "study"
    argv = ["tune", "--recipe", "mlp-regression", "--space", str(space), "--trials", "1"]
    argv += ["--out", str(study_dir), "--pruner", "none", *FAST]
    done = subprocess.run(
        [sys.executable, "-c", SIGTERM_AT, where, *argv], capture_output=True, text=True
    )
    assert done.returncode == 143, (done.returncode, done.stderr[-3000:])  # not killed by it
    assert "hookloop tune: stopped by SIGTERM; the same command continues" in done.stderr
    if where == "validate":  # nothing written yet
        assert not study_dir.exists()
        return
    # the study was written whole (a held signal), and no trial was left RUNNING
    states = _states(study_dir / "study.db") if (study_dir / "study.db").exists() else []
    assert (study_dir / "tune.yaml").is_file()
    assert states == ([] if where == "prepare" else [(0, "COMPLETE")])
