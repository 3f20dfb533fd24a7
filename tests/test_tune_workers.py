"""``hookloop tune --workers 2``: a study SIGKILLed half-way and restarted with the same
command finishes with exactly N trials, none lost or run twice (counted in the SQLite file)."""

from __future__ import annotations

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
from test_tune import FAST, SPACE

pytest.importorskip("optuna")

TRIALS = 20
#: How long the first run may take to reach the kill point (a third of the trials done):
#: a guard against a hang, ~10 s on idle cores; generous, as the full suite shares two.
DEADLINE_S = 150
#: How long a whole `hookloop tune` process may take: a guard against a hang, not a speed
#: test. Under the full suite on two cores, the restart (two fresh workers, two thirds of
#: the trials) once took over 60 s; it takes ~10 s on idle cores.
RUN_LIMIT_S = 240
RUNNING_WITH_PARAMS = (
    "SELECT DISTINCT t.number FROM trials t JOIN trial_params p ON p.trial_id = t.trial_id "
    "WHERE t.state = 'RUNNING'"
)


def _query(db: Path, sql: str, *, polling: bool = False) -> list[tuple]:
    """Rows of ``sql``. While ``polling`` a live study, read-only and [] until the file and
    its tables exist. Otherwise read-write and errors raise: after a SIGKILL mid-transaction
    the file has a hot journal that only a connection allowed to write can roll back (a
    read-only one fails, which once read as 'no rows')."""
    if not polling:
        with sqlite3.connect(db, timeout=30) as conn:
            return conn.execute(sql).fetchall()
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:  # not created yet, or its tables not yet
        return []


def _states(db: Path, *, polling: bool = False) -> dict[str, int]:
    return dict(_query(db, "SELECT state, COUNT(*) FROM trials GROUP BY state", polling=polling))


def _attrs(db: Path, *, polling: bool = False) -> dict[int, dict]:
    rows = _query(
        db,
        "SELECT t.number, a.key, a.value_json FROM trials t "
        "JOIN trial_user_attributes a ON a.trial_id = t.trial_id",
        polling=polling,
    )
    out: dict[int, dict] = {}
    for number, key, value in rows:
        out.setdefault(number, {})[key] = json.loads(value)
    return out


def _params(db: Path) -> dict[int, dict]:
    rows = _query(
        db,
        "SELECT t.number, p.param_name, p.param_value FROM trials t "
        "JOIN trial_params p ON p.trial_id = t.trial_id",
    )
    out: dict[int, dict] = {}
    for number, name, value in rows:
        out.setdefault(number, {})[name] = value
    return out


def _alive(pid: int) -> bool:
    from hookloop.processes import process_alive

    return process_alive(pid)


@pytest.mark.slow
def test_a_killed_study_restarted_with_the_same_command_loses_and_repeats_no_trial(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    study_dir = tmp_path / "study"
    db = study_dir / "study.db"
    command = [
        sys.executable, "-m", "hookloop", "tune", "--recipe", "mlp-regression",
        "--space", str(space), "--trials", str(TRIALS), "--workers", "2",
        "--out", str(study_dir), "--no-plots", *FAST, *SERVICES_OFF, "train.max_steps=48",
    ]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Kill on an observed event: a third of the trials done and both workers running a
    # trial with its parameters drawn (two, so that one is surely still running at the kill).
    deadline = time.monotonic() + DEADLINE_S
    while True:
        states = _states(db, polling=True)
        done = states.get("COMPLETE", 0) + states.get("PRUNED", 0)
        pids = {a["pid"] for a in _attrs(db, polling=True).values() if "pid" in a}
        running = _query(db, RUNNING_WITH_PARAMS, polling=True)
        if done >= TRIALS // 3 and len(pids) == 2 and len(running) == 2:
            break
        assert driver.poll() is None, driver.stderr.read().decode()
        assert time.monotonic() < deadline, f"no progress: {states}"
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    driver.stderr.close()
    assert done < TRIALS
    # The workers die with the driver.
    workers = {a["pid"] for a in _attrs(db).values() if "pid" in a}
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived its driver"
        time.sleep(0.02)
    interrupted = [n for (n,) in _query(db, "SELECT number FROM trials WHERE state = 'RUNNING'")]
    before = _params(db)
    assert any(n in before for n in interrupted), "a trial was running with its parameters"

    # The same command again finishes the study.
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert result.returncode == 0, result.stderr

    states = _states(db)
    assert states.get("COMPLETE", 0) + states.get("PRUNED", 0) == TRIALS, states
    assert states.get("PRUNED", 0) >= 1, states
    assert "RUNNING" not in states and "WAITING" not in states
    assert states.get("FAIL", 0) == len(interrupted), states
    attrs, params = _attrs(db), _params(db)
    for number in interrupted:
        assert attrs[number]["interrupted"] is True
        assert "interrupted: process" in attrs[number]["fail_reason"]
        retries = [n for n, a in attrs.items() if a.get("retry_of") == number]
        assert len(retries) == 1, f"trial {number} retried {len(retries)} times"
        (retry,) = retries
        # the same parameters (those it had drawn: a worker may die while drawing them)
        assert {k: params[retry][k] for k in before.get(number, {})} == before.get(number, {})
        assert _query(db, f"SELECT state FROM trials WHERE number = {retry}")[0][0] in (
            "COMPLETE",
            "PRUNED",
        )
    # Every finished trial is a run directory; its config holds its parameters.
    finished = _query(db, "SELECT number FROM trials WHERE state IN ('COMPLETE', 'PRUNED')")
    for (number,) in finished:
        config = yaml.safe_load((study_dir / f"trial-{number:04d}" / "config.yaml").read_text())
        assert config["model"]["hidden"] == params[number]["model.hidden"]
    assert (study_dir / "best_config.yaml").is_file()
    assert os.path.getsize(study_dir / "best_trials.txt") > 0


@pytest.mark.slow
def test_under_torchrun_both_ranks_train_rank_zeros_trials_and_stop_together(tmp_path):
    from _dist_launch import torchrun

    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    study_dir = tmp_path / "study"
    command = [
        *torchrun(2), "-m", "hookloop", "tune", "--recipe", "mlp-regression",
        "--space", str(space), "--trials", "8", "--out", str(study_dir), "--no-plots",
        *FAST, *SERVICES_OFF,
    ]  # fmt: skip
    # A rank that missed a prune would wait in a collective for ever: the timeout says so.
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert result.returncode == 0, result.stderr[-3000:]

    db = study_dir / "study.db"
    states = _states(db)
    assert states.get("COMPLETE", 0) + states.get("PRUNED", 0) == 8, states
    assert states.get("PRUNED", 0) >= 1, states  # the seed-0 study prunes trials 6 and 7
    for number, state in _query(db, "SELECT number, state FROM trials"):
        run = study_dir / f"trial-{number:04d}"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r["step"] for r in records if r["kind"] == "eval"]
        # 256 samples in batches of 32 over two ranks: an epoch is 4 steps (8 on one rank)
        assert evals[0] == 4, (number, evals)
        end = records[-1]
        if state == "PRUNED":
            assert end["status"] == "stopped" and "OptunaPruning" in end["stop_reason"]
        else:
            assert end["status"] == "finished" and end["step"] == 24


def test_workers_share_the_cores_and_take_a_gpu_each_by_index(monkeypatch):
    from hookloop.tune.cli import cpu_cores, worker_env

    monkeypatch.setattr("hookloop.tune.cli.cpu_cores", lambda: 16)
    env = worker_env(1, 4, environ={})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4"
    assert env["HOOKLOOP_TUNE_THREADS"] == "4" and "CUDA_VISIBLE_DEVICES" not in env
    assert worker_env(0, 32, environ={})["OMP_NUM_THREADS"] == "1"  # never 0
    # the override: --threads-per-worker, else the caller's own OMP_NUM_THREADS
    assert worker_env(0, 4, threads=2, environ={"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "2"
    assert worker_env(0, 4, environ={"OMP_NUM_THREADS": "8"})["MKL_NUM_THREADS"] == "8"
    # GPUs: worker i gets the (i % count)-th of those the driver sees
    assert [worker_env(i, 3, gpus=2, environ={})["CUDA_VISIBLE_DEVICES"] for i in range(3)] == [
        "0",
        "1",
        "0",
    ]
    visible = {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert worker_env(1, 2, gpus=2, environ=visible)["CUDA_VISIBLE_DEVICES"] == "7"
    monkeypatch.undo()
    assert cpu_cores() >= 1
