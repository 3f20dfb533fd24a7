"""The session's guard on the user's job registry (tests/_registry_guard.py) blames the
entries the tests made, and none a job the user started meanwhile made.

Each job here registers through hookloop's own registry code (hookloop.control.registry)
into a registry directory of the test's, which stands for the user's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _registry_guard import SESSION_MARK, Session, entries, user_registries

#: A job that registers (``argv``: registry, out_dir, stop file) and waits for the stop file.
JOB = """
import os, sys, time
from hookloop.control.registry import JobDir, JobRecord, new_job_id

registry, out_dir, stop = sys.argv[1:4]
job_id = new_job_id()
job = JobDir(job_id, registry)
job.create()
job.write_token("secret")
job.write_endpoint(JobRecord(job_id=job_id, pid=os.getpid(), url="http://127.0.0.1:9",
    host="127.0.0.1", port=9, started=time.time(), out_dir=out_dir))
for _ in range(1200):  # at most two minutes
    if os.path.exists(stop):
        break
    time.sleep(0.1)
job.remove()
"""

#: Starts JOB in a new session and exits: the job is no descendant of the test's process.
DETACHED = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], start_new_session=True,
    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def _env(mark: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != SESSION_MARK}
    return env if mark is None else {**env, SESSION_MARK: mark}


def _new_job(registry: Path, known: set[Path]) -> Path:
    """The one job directory not in ``known``, once its endpoint is written."""
    for _ in range(1200):  # the jobs import torch (hookloop's package does) on a busy machine
        ready = {d for d in entries([registry]) - known if (d / "endpoint.json").is_file()}
        if ready:
            assert len(ready) == 1, ready
            return ready.pop()
        time.sleep(0.1)
    raise AssertionError(f"no job registered in {registry} beside {sorted(known)}")


def _owner(job_dir: Path) -> int:
    return json.loads((job_dir / "endpoint.json").read_text())["pid"]


def test_only_the_sessions_own_jobs_are_blamed(tmp_path):
    registry, stop = tmp_path / "registry", tmp_path / "stop"
    root = tmp_path / "session"  # the session's temp root: its tests' runs go under it
    session = Session(temp_root=root, pid=os.getpid(), mark="this-session")
    old = registry / "job_1_host_1"  # there before the session began
    old.mkdir(parents=True)
    before = entries([registry])
    project = str(tmp_path / "project" / "runs" / "mine")  # the user's own run directory
    python = sys.executable
    started = []
    try:
        # the user's `hookloop train` in another terminal: not ours in any way
        subprocess.run(
            [python, "-c", DETACHED, JOB, str(registry), project, str(stop)],
            env=_env(None),
            check=True,
        )
        user = _new_job(registry, before)
        # a test's child that lost the session's environment: it descends from this process
        started.append(
            subprocess.Popen([python, "-c", JOB, str(registry), project, str(stop)], env=_env(None))
        )
        child = _new_job(registry, {*before, user})
        # a test's daemon (detached, so no descendant) still carries the session's mark
        subprocess.run(
            [python, "-c", DETACHED, JOB, str(registry), project, str(stop)],
            env=_env("this-session"),
            check=True,
        )
        daemon = _new_job(registry, {*before, user, child})
        # a test's job that died without removing its entry: its run lies in the temp root
        dead = registry / "job_2_host_999999999"
        dead.mkdir()
        record = {"job_id": dead.name, "pid": 999999999, "out_dir": str(root / "t" / "run")}
        (dead / "endpoint.json").write_text(json.dumps(record))

        assert _owner(user) not in (os.getpid(), *(p.pid for p in started))
        assert session.blamed(before, [registry]) == sorted([child, daemon, dead])
        assert not session.made(user) and not session.made(old)
    finally:
        stop.touch()
        for job_dir in entries([registry]):  # the detached jobs, by their own pid
            with contextlib.suppress(OSError, ValueError, KeyError):
                if _owner(job_dir) not in (999999999, *(p.pid for p in started)):
                    os.kill(_owner(job_dir), signal.SIGTERM)
        for proc in started:
            proc.wait(timeout=120)


def test_the_registries_watched_are_all_those_a_job_announces_itself_in(tmp_path, monkeypatch):
    from hookloop.control.registry import registries

    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    monkeypatch.delenv("HOOKLOOP_JOBS_DIR")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert len(registries()) == 3  # hookloop's and Forgather's two
    assert set(registries()) <= set(user_registries(env))
