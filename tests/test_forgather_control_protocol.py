"""Forgather's control protocol, spoken to a live job the way Forgather's client does.

The job is an HF-dialect training with ``TrainerControlCallback`` built with
Forgather's parameters; the client is plain ``urllib`` (no hookloop client): it
finds the job's ``endpoint.json`` and ``auth_token`` in the jobs directory,
lists ``GET /jobs``, reads ``GET /jobs/{id}/status`` for ``global_step``,
``status`` and the flat log keys, and posts ``{"command": ...}`` to
``/jobs/{id}/control``, expecting ``200 {"status": "acknowledged"}``.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from _control_support import train_in_background
from hookloop.compat.hf import (
    Trainer,
    TrainerCallback,
    TrainerControlCallback,
    TrainingArguments,
)
from hookloop.rundir import RunDir
from hookloop.testing import TinyModel, ToyData

pytest.importorskip("aiohttp")

WAIT_S = 30.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Slow(TrainerCallback):
    """A few milliseconds a step, so that the job is still running while we talk to it."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.003)


def http(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with _NO_PROXY.open(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def start_job(tmp_path: Path, control: TrainerControlCallback) -> tuple[threading.Thread, dict]:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        logging_dir=str(tmp_path / "logs"),
        per_device_train_batch_size=8,
        max_steps=10**6,
        logging_steps=5,
        save_strategy="no",
        use_cpu=True,
    )
    trainer = Trainer(
        TinyModel(),
        args,
        train_dataset=ToyData(n=64),
        loss_fn=TinyModel.loss_fn,
        callbacks=[control, Slow()],
    )
    return train_in_background(trainer, {"trainer": trainer})


def wait_for_endpoint(jobs: Path, thread: threading.Thread) -> Path:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = list(jobs.glob("*/endpoint.json"))
        if found:
            return found[0]
        assert thread.is_alive() and time.monotonic() < deadline, "no endpoint.json appeared"
        time.sleep(0.02)


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    path = tmp_path / "jobs"
    monkeypatch.setenv("HOOKLOOP_JOBS_DIR", str(path))
    return path


def test_a_forgather_client_stops_a_live_job_over_raw_http(tmp_path, jobs):
    control = TrainerControlCallback(
        job_id=None, port=None, enable_http=True, host="127.0.0.1", auth_token=None
    )
    thread, outcome = start_job(tmp_path, control)
    try:
        endpoint_file = wait_for_endpoint(jobs, thread)
        endpoint = json.loads(endpoint_file.read_text())
        assert re.fullmatch(r"job_\d+_.+_\d+", endpoint["job_id"])
        assert endpoint_file.parent.name == endpoint["job_id"]
        assert endpoint["pid"] == os.getpid() and endpoint["host"] == "127.0.0.1"
        assert abs(endpoint["started_at"] - time.time()) < 60
        assert endpoint["output_dir"] == str((tmp_path / "out").resolve())
        assert endpoint["logging_dir"]
        token_file = endpoint_file.parent / "auth_token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        base = f"http://{endpoint['host']}:{endpoint['port']}"
        job = f"{base}/jobs/{endpoint['job_id']}"

        assert http("GET", f"{job}/status")[0] == 401
        assert http("GET", f"{base}/jobs", token="wrong")[0] == 401
        code, listing = http("GET", f"{base}/jobs", token=token)
        assert code == 200 and [j["job_id"] for j in listing["jobs"]] == [endpoint["job_id"]]
        assert listing["jobs"][0]["port"] == endpoint["port"]

        deadline = time.monotonic() + WAIT_S
        while "loss" not in (status := http("GET", f"{job}/status", token=token)[1]):
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["job_id"] == endpoint["job_id"] and status["status"] == "running"
        assert status["global_step"] >= 5 and status["max_steps"] == 10**6
        assert isinstance(status["loss"], float) and "epoch" in status and "timestamp" in status

        code, answer = http("POST", f"{job}/control", {"command": "reboot"}, token=token)
        assert code == 400 and "save_and_stop" in answer["valid_commands"]
        code, answer = http("POST", f"{job}/control", {"command": "save_and_stop"}, token=token)
        assert code == 200, answer
        assert answer["status"] == "acknowledged" and answer["command"] == "save_and_stop"
        assert isinstance(answer["timestamp"], float) and answer["message"]
    finally:
        thread.join(WAIT_S)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.exit_code == 0 and result.step < 10**6
    # save_and_stop saved before stopping: one checkpoint, of the step it stopped at
    saved = sorted(p.name for p in RunDir(tmp_path / "out").checkpoints.glob("step-*"))
    assert saved == [f"step-{result.step:08d}"]
    assert not endpoint_file.parent.exists()  # the job directory goes when the job ends


def test_disable_auth_serves_without_a_token_and_says_so_loudly(tmp_path, jobs, capsys):
    control = TrainerControlCallback("open-job", None, True, "127.0.0.1", None, True)
    with pytest.warns(RuntimeWarning, match="WITHOUT AUTHENTICATION"):
        thread, outcome = start_job(tmp_path, control)
        try:
            endpoint_file = wait_for_endpoint(jobs, thread)
            endpoint = json.loads(endpoint_file.read_text())
            assert not (endpoint_file.parent / "auth_token").exists()
            job = f"http://127.0.0.1:{endpoint['port']}/jobs/open-job"
            code, status = http("GET", f"{job}/status")
            assert code == 200 and status["job_id"] == "open-job"
            code, answer = http("POST", f"{job}/control", {"command": "graceful_stop"})
            assert code == 200 and answer["status"] == "acknowledged"
        finally:
            thread.join(WAIT_S)
    assert outcome["result"].exit_code == 0
    assert "WITHOUT AUTHENTICATION" in capsys.readouterr().err


def test_disable_auth_off_loopback_needs_an_explicit_second_yes():
    with pytest.raises(ValueError, match="allow_remote_without_auth"):
        TrainerControlCallback(host="0.0.0.0", disable_auth=True)
    allowed = TrainerControlCallback(
        host="0.0.0.0", disable_auth=True, allow_remote_without_auth=True
    )
    assert allowed.disable_auth is True
    with pytest.raises(ValueError, match="disable_auth must be True or False"):
        TrainerControlCallback(disable_auth="yes")


def test_hookloop_jobs_lists_an_endpoint_written_by_a_forgather_trainer(jobs, capsys):
    from hookloop.control.cli import main_jobs

    job_dir = jobs / "job_1700000000_host_42"
    job_dir.mkdir(parents=True, mode=0o700)
    forgather_endpoint = {  # the fields Forgather's trainer writes, and no more
        "job_id": job_dir.name,
        "host": "127.0.0.1",
        "port": 8900,
        "pid": os.getpid(),
        "started_at": 1700000000.5,
        "output_dir": "/runs/x",
        "logging_dir": "/runs/x/logs",
    }
    (job_dir / "endpoint.json").write_text(json.dumps(forgather_endpoint))
    assert main_jobs(["--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["job_id"] == job_dir.name and listed["url"] == "http://127.0.0.1:8900"
    assert listed["out_dir"] == "/runs/x"


def test_job_ids_are_forgathers_and_stay_unique_within_a_second():
    from hookloop.control.registry import new_job_id, valid_job_id

    ids = [new_job_id() for _ in range(3)]
    # job_<unix time>_<host>_<pid>, and _<n> for a later one made in the same second
    assert all(re.fullmatch(rf"job_\d+_.+_{os.getpid()}(_\d+)?", i) for i in ids), ids
    assert len(set(ids)) == 3 and all(valid_job_id(i) for i in ids)
