"""Several machines on one study: two ``hookloop tune`` drivers on one shared storage, each
with its own directory and host name (``HOOKLOOP_TUNE_HOST``), one SIGKILLed for good.

The storage is a SQLite file both reach; tests/test_tune_postgres.py runs the same drivers
(these helpers) on a real PostgreSQL server."""

from __future__ import annotations

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
from test_tune import FAST

optuna = pytest.importorskip("optuna")

TRIALS = 4
SPACE = {"optimizer.lr": {"low": 1.0e-3, "high": 0.3, "log": True}}


def driver(
    tmp_path: Path, url: str, host: str, trials: int = TRIALS
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one driver, standing for machine ``host``: its
    own directory ``tmp_path/host``, the shared storage ``url``, a heartbeat every second."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    command = [
        sys.executable, "-m", "hookloop", "tune", "--recipe", "mlp-regression",
        "--space", str(space), "--trials", str(trials), "--out", str(tmp_path / host),
        "--storage", url, "--heartbeat", "1", "--pruner", "none", "--no-plots",
        *FAST, *SERVICES_OFF,
    ]  # fmt: skip
    return command, {**os.environ, "HOOKLOOP_TUNE_HOST": host}


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run_two_drivers(tmp_path: Path, url: str, kill_alpha_when=None) -> None:
    """Drivers ``alpha`` and ``beta`` on one study; both must exit 0. With
    ``kill_alpha_when`` (a function true once alpha runs a trial with its parameters
    drawn), alpha is SIGKILLed for good then, and only beta must exit 0."""
    alpha, beta = start(*driver(tmp_path, url, "alpha")), start(*driver(tmp_path, url, "beta"))
    try:
        if kill_alpha_when is not None:
            deadline = time.monotonic() + 120
            while not kill_alpha_when():
                assert alpha.poll() is None, alpha.stderr.read().decode()
                assert time.monotonic() < deadline, "alpha never ran a trial"
                time.sleep(0.02)
            alpha.send_signal(signal.SIGKILL)
            alpha.wait()
        else:
            _, err = alpha.communicate(timeout=120)
            assert alpha.returncode == 0, err.decode()[-3000:]
        _, err = beta.communicate(timeout=120)
        assert beta.returncode == 0, err.decode()[-3000:]
    finally:
        for proc in (alpha, beta):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.close()


#: The RUNNING trials of driver alpha that have their parameters drawn (SQL on the storage).
ALPHA_RUNNING = (
    "SELECT t.number FROM trials t "
    "JOIN trial_user_attributes a ON a.trial_id = t.trial_id "
    "JOIN trial_params p ON p.trial_id = t.trial_id "
    "WHERE t.state = 'RUNNING' AND a.key = 'host' AND a.value_json = '\"alpha\"'"
)


def check_shared_study(study, tmp_path: Path, *, alpha_lost: bool) -> None:
    """Exactly TRIALS COMPLETE or PRUNED, none left running, distinct parameters; surplus
    claims untrained; with ``alpha_lost``, alpha's cut trial was failed by its heartbeat
    and retried once, by beta, with the same parameters."""
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == TRIALS, [(t.number, t.state.name) for t in study.trials]
    assert not [t for t in study.trials if t.state.name in ("RUNNING", "WAITING")]
    # the two drivers' samplers drew different values (their seeds differ)
    assert len({t.params["optimizer.lr"] for t in done}) == TRIALS
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    # a driver that asked for one trial too many at the same moment as the other gives it
    # up untrained (surplus), so that the count stays exact
    for trial in failed:
        if trial.user_attrs.get("surplus"):
            assert (
                not trial.params
                and not (
                    tmp_path / trial.user_attrs["host"] / (f"trial-{trial.number:04d}")
                ).exists()
            )
    lost = [t for t in failed if not t.user_attrs.get("surplus")]
    if not alpha_lost:
        assert not lost, [t.user_attrs.get("fail_reason") for t in lost]
        return
    assert lost and all(t.user_attrs["host"] == "alpha" for t in lost)
    for trial in lost:  # failed by its heartbeat, retried once, by beta
        (retry,) = [
            t
            for t in study.trials
            if t.user_attrs.get("retry_of") == trial.number and not t.user_attrs.get("surplus")
        ]
        assert retry.user_attrs["retry_reason"] == "no heartbeat from alpha"
        assert retry.user_attrs["host"] == "beta" and retry.params == trial.params
        assert retry.state.name == "COMPLETE"


@pytest.mark.slow
def test_two_drivers_share_a_study_and_a_lost_ones_trial_is_finished_by_the_other(
    tmp_path, monkeypatch
):
    db = tmp_path / "shared.db"
    url = f"sqlite:///{db}"

    def alpha_running() -> bool:
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
                return bool(conn.execute(ALPHA_RUNNING).fetchall())
        except sqlite3.OperationalError:
            return False

    run_two_drivers(tmp_path, url, kill_alpha_when=alpha_running)
    study = optuna.load_study(study_name="hookloop", storage=url)
    check_shared_study(study, tmp_path, alpha_lost=True)
    # alpha, started again, has nothing left to run, and writes the best config from the
    # storage (its best trial may have run on beta)
    monkeypatch.setenv("HOOKLOOP_TUNE_HOST", "alpha")
    assert main(driver(tmp_path, url, "alpha")[0][3:]) == 0  # in this process
    best = yaml.safe_load((tmp_path / "alpha" / "best_config.yaml").read_text())
    assert best["optimizer"]["lr"] == study.best_params["optimizer.lr"]
    assert len(optuna.load_study(study_name="hookloop", storage=url).trials) == len(study.trials)


def test_a_journal_file_storage_holds_a_study_and_a_bad_url_is_one_line(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    journal = tmp_path / "study.log"
    argv = ["tune", "--recipe", "mlp-regression", "--space", str(space), "--trials", "2"]
    argv += ["--no-plots", "--pruner", "none", *FAST]
    assert (
        main(
            [*argv[:7], "--out", str(tmp_path / "j"), "--storage", f"journal:{journal}", *argv[7:]]
        )
        == 0
    )
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    trials = optuna.load_study(study_name="hookloop", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert (tmp_path / "j" / "best_config.yaml").is_file()
    capsys.readouterr()
    assert (
        main([*argv[:7], "--out", str(tmp_path / "b"), "--storage", "nosuch://x", *argv[7:]]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot open the study's storage --storage nosuch://x" in err[0]
    assert "journal:FILE" in err[0] and not (tmp_path / "b").exists()
    assert main([*argv[:7], "--out", str(tmp_path / "h"), "--heartbeat", "-1", *argv[7:]]) == 2
    assert "--heartbeat must be an int >= 0 (0: off), got -1" in capsys.readouterr().err


def test_a_trial_another_driver_ended_is_dropped_in_one_line_and_the_study_goes_on(
    tmp_path, monkeypatch, capsys
):
    """Under load a driver misses its trial's heartbeats; another driver fails the trial
    and queues it again (what its ``fail_stale_trials`` does). The first one, still
    training it, finds the trial finished when it next writes to it."""
    from hookloop import recipes
    from hookloop.callback import Callback
    from hookloop.recipes import Recipe, mlp
    from hookloop.tune.study import requeue

    url = f"sqlite:///{tmp_path / 'shared.db'}"

    class EndedElsewhere(Callback):
        ended = False

        def on_train_step_end(self, ctx) -> None:
            if ctx.state.step != 12 or EndedElsewhere.ended:
                return
            EndedElsewhere.ended = True  # as the other driver: fail it, queue it again
            storage = optuna.storages.RDBStorage(url)
            study = optuna.load_study(study_name="hookloop", storage=storage)
            (running,) = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
            study_id = storage.get_study_id_from_name("hookloop")
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, running.number)
            storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
            requeue(study, study.trials[running.number], reason="no heartbeat from alpha")

    def build(cfg):
        parts = mlp.build(cfg)
        parts.callbacks.append(EndedElsewhere())
        return parts

    recipes._load_builtin()
    monkeypatch.setitem(
        recipes._RECIPES,
        "mlp-ended",
        Recipe(
            "mlp-ended", "mlp-regression; trial failed by another driver", mlp.default_config, build
        ),
    )
    command, _ = driver(tmp_path, url, "beta", trials=2)
    argv = [*command[3:], "--heartbeat", "0"]
    argv[argv.index("mlp-regression")] = "mlp-ended"
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    trials = [line for line in err if line.startswith("hookloop tune: trial ")]
    assert len(trials) == 3, err  # one line each: the ended trial, its retry, the other
    assert trials[0].startswith("hookloop tune: trial 0 failed: ended by another driver")
    log = (tmp_path / "beta" / "workers" / "worker-0.log").read_text()
    assert "trial 0 was ended (FAIL) by another driver while it ran here" in log
    study = optuna.load_study(study_name="hookloop", storage=url)
    states = [(t.number, t.state.name) for t in study.trials]
    assert states == [(0, "FAIL"), (1, "COMPLETE"), (2, "COMPLETE")]
    assert study.trials[1].user_attrs["retry_of"] == 0
