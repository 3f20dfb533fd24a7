"""Credentials stay private: a ``--storage`` password is never printed nor written to a file
(``tune.yaml`` keeps the URL masked, the study's processes get it from the command or
``$HOOKLOOP_TUNE_STORAGE``), and the job registry's token is only ever written into a file
that is already 0600."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hookloop.app.cli import main
from hookloop.control.registry import JobDir, JobRecord
from hookloop.tune import credentials
from test_tune import FAST

optuna = pytest.importorskip("optuna")

SECRET = "hunter2-s3cret"
SPACE = {"optimizer.lr": {"low": 1.0e-3, "high": 0.3, "log": True}}


def _free_port() -> int:
    with socket.socket() as probe:  # nothing listens on it once closed
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tune(tmp_path: Path, study: Path, *extra: str) -> list[str]:
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    return ["tune", "--recipe", "mlp-regression", "--space", str(space), "--out", str(study),
            "--no-plots", "--pruner", "none", *extra, *FAST]  # fmt: skip


def _files_holding(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_the_masked_url_keeps_everything_but_the_password():
    url = f"postgresql+psycopg2://tune:{SECRET}@db.internal:5432/studies?sslmode=require"
    assert (
        credentials.mask(url)
        == "postgresql+psycopg2://tune:***@db.internal:5432/studies?sslmode=require"
    )
    assert credentials.mask("mysql://u@h/db?password=p%40ss") == "mysql://u@h/db?password=***"
    assert credentials.mask("redis://:pw@h:6379") == "redis://:***@h:6379"
    for plain in ("sqlite:////abs/study.db", "journal:study.log", "postgresql://tune@db/x"):
        assert credentials.mask(plain) == plain  # nothing to hide, nothing changed
    masked = credentials.mask(url)
    assert credentials.restore(masked, {credentials.STORAGE_ENV: url}) == url
    other = url.replace("db.internal", "db.elsewhere")  # another storage's URL is not taken
    assert credentials.restore(masked, {credentials.STORAGE_ENV: other}) == masked


def test_an_unreachable_storage_never_shows_its_password(tmp_path):
    url = f"postgresql://tune:{SECRET}@127.0.0.1:{_free_port()}/studies"
    study = tmp_path / "study"
    command = [sys.executable, "-m", "hookloop", *_tune(tmp_path, study, "--trials", "1")]
    done = subprocess.run([*command, "--storage", url], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr  # the documented exit: the storage cannot be opened
    assert SECRET not in done.stderr + done.stdout
    assert f"--storage postgresql://tune:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in done.stderr
    assert not study.exists()


def test_a_study_moved_to_an_unreachable_storage_saves_no_password(tmp_path, capsys):
    study = tmp_path / "study"
    assert main(_tune(tmp_path, study, "--trials", "1")) == 0
    url = f"postgresql://tune:{SECRET}@127.0.0.1:{_free_port()}/studies"
    assert main([*_tune(tmp_path, study, "--trials", "1"), "--storage", url]) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and "cannot open the study's storage" in err
    saved = yaml.safe_load((study / "tune.yaml").read_text())
    assert saved["storage"] == credentials.mask(url)
    assert not _files_holding(study, SECRET)


@pytest.mark.slow
def test_workers_and_a_later_plot_get_the_password_from_the_command_or_the_environment(tmp_path):
    """A storage whose URL holds a password that works: SQLite through a URI, which ignores
    the ``password`` parameter. Two workers (separate processes reading tune.yaml) reach it."""
    study = tmp_path / "study"
    url = f"sqlite:///file:{tmp_path / 'shared.db'}?mode=rwc&uri=true&password={SECRET}"
    command = [sys.executable, "-m", "hookloop", *_tune(tmp_path, study, "--trials", "2")]
    done = subprocess.run(
        [*command, "--workers", "2", "--storage", url], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert SECRET not in done.stderr + done.stdout
    assert not _files_holding(study, SECRET)  # tune.yaml, worker logs, trial logs
    assert yaml.safe_load((study / "tune.yaml").read_text())["storage"] == credentials.mask(url)
    plot = [sys.executable, "-m", "hookloop", "plot", str(study)]
    env = {k: v for k, v in os.environ.items() if k != credentials.STORAGE_ENV}
    refused = subprocess.run(plot, capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and SECRET not in refused.stderr
    assert f"set ${credentials.STORAGE_ENV} to the whole URL" in refused.stderr
    env[credentials.STORAGE_ENV] = url
    drawn = subprocess.run(plot, capture_output=True, text=True, env=env)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert (study / "plots" / "optimization_history.png").is_file()


@pytest.mark.parametrize("write", ["write_token", "write_endpoint"])
def test_registry_files_are_created_0600_before_a_byte_is_written(tmp_path, monkeypatch, write):
    """Not written and then chmod-ed: every write goes into a file no one else could open."""
    job = JobDir("job-modes", tmp_path / "jobs")
    job.create()
    record = JobRecord(job_id="job-modes", pid=os.getpid(), url="http://127.0.0.1:9",
                       host="127.0.0.1", port=9, started=0.0)  # fmt: skip
    modes = []
    real_write = os.write

    def watched(fd: int, data: bytes) -> int:
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", watched)
    old = os.umask(0)  # the loosest umask: the mode must come from the create itself
    try:
        path = job.write_token("a-secret-token") if write == "write_token" else None
        path = path or job.write_endpoint(record)
    finally:
        os.umask(old)
        monkeypatch.undo()
    assert modes and set(modes) == {0o600}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
