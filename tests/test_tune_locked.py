"""A locked SQLite study database delays hookloop's records of a trial instead of killing
the worker that writes them (hookloop.tune.storage.retry_locked).

On a loaded machine a worker recording a cut trial ("interrupted by SIGTERM") once met
"database is locked" past SQLite's wait and died with a traceback, leaving its trial for
the driver to recover as "died while the trial ran"."""

from __future__ import annotations

import sqlite3
import threading

import pytest

optuna = pytest.importorskip("optuna")

from hookloop.tune import storage as tune_storage  # noqa: E402
from hookloop.tune.spec import TuneSpec  # noqa: E402
from hookloop.tune.storage import open_study, retry_locked  # noqa: E402
from hookloop.tune.trial import interrupted  # noqa: E402

SPACE = {"optimizer.lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}}


def locked_for(db, seconds: float) -> threading.Event:
    """Hold SQLite's exclusive lock on ``db`` from another connection for ``seconds``;
    the event is set once the lock is held."""
    held = threading.Event()

    def hold() -> None:
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        held.set()
        threading.Event().wait(seconds)
        conn.execute("COMMIT")
        conn.close()

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(30)
    return held


@pytest.fixture
def study(tmp_path, monkeypatch):
    monkeypatch.setattr(tune_storage, "SQLITE_BUSY_SECONDS", 0.05)  # SQLite gives up at once
    TuneSpec(recipe="mlp-regression", space=SPACE, trials=2).save(tmp_path)
    return open_study(TuneSpec.load(tmp_path), tmp_path), tmp_path / "study.db"


def test_a_locked_database_failed_the_write_and_now_only_delays_it(study):
    study, db = study
    trial = study.ask()
    locked_for(db, 1.0)
    with pytest.raises(optuna.exceptions.StorageInternalError):  # what the worker died of
        trial.set_user_attr("fail_reason", "interrupted by SIGTERM")
    locked_for(db, 1.0)
    interrupted(trial, "interrupted by SIGTERM")  # waits for the lock, then records
    cut = study.trials[trial.number]
    assert cut.state.name == "FAIL" and cut.user_attrs["fail_reason"] == "interrupted by SIGTERM"
    assert [t.state.name for t in study.trials] == ["FAIL", "WAITING"]  # queued again


def test_other_errors_are_not_retried(monkeypatch):
    calls = []

    def write() -> None:
        calls.append(1)
        raise ValueError("not a lock")

    with pytest.raises(ValueError, match="not a lock"):
        retry_locked(write)
    assert calls == [1]
    monkeypatch.setattr(tune_storage, "LOCKED_PATIENCE_SECONDS", 0.0)

    def locked() -> None:
        calls.append(1)
        raise sqlite3.OperationalError("database is locked")

    with pytest.raises(sqlite3.OperationalError):  # past its patience, the error stands
        retry_locked(locked)
    assert len(calls) == 2


def test_asking_for_a_trial_waits_out_the_lock_too(study):
    """The other write that killed a worker: Optuna's ``ask`` (the driver's claim)."""
    study, db = study
    locked_for(db, 1.0)
    with pytest.raises(optuna.exceptions.StorageInternalError):
        study.ask()
    locked_for(db, 1.0)
    trial = retry_locked(study.ask)
    assert study.trials[trial.number].state.name == "RUNNING"
