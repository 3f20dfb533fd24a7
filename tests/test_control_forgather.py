"""Control across hookloop and Forgather, both ways, with nothing configured.

A hookloop job announces itself in hookloop's registry and in the two Forgather reads
(``<config dir>/forgather/jobs`` for its current client, ``~/.forgather/jobs`` for its
older one); ``hookloop jobs`` / ``ctl`` find Forgather's jobs there and speak its keys.
The clients here are plain ``urllib`` doing what Forgather's client does (endpoint.json,
the token file when there is one, ``{"command", "data"}`` bodies); Forgather's own
client is run by hand against a real job (docs/forgather.md). Everything is on
127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import http.server as http_server
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
from hookloop.compat.hf import Trainer, TrainerCallback, TrainingArguments
from hookloop.control import list_jobs, parse_request
from hookloop.control.cli import main_ctl, main_jobs
from hookloop.control.registry import (
    JobRecord,
    RegistryError,
    forgather_jobs_dirs,
    registries,
)
from hookloop.control.server import COMMANDS, CommandError, TrainerControlCallback
from hookloop.testing import TinyModel, ToyData

pytest.importorskip("aiohttp")

WAIT_S = 30.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def places(tmp_path, monkeypatch) -> dict[str, Path]:
    """No registry named: hookloop's default one and Forgather's two, all under tmp_path."""
    monkeypatch.delenv("HOOKLOOP_JOBS_DIR", raising=False)
    home, config, runtime = tmp_path / "home", tmp_path / "config", tmp_path / "runtime"
    for path in (home, config, runtime):
        path.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return {
        "hookloop": runtime / "hookloop" / "jobs",
        "forgather": config / "forgather" / "jobs",
        "forgather_old": home / ".forgather" / "jobs",
    }


def call(method: str, url: str, body: Any = None, token: str = "") -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with _NO_PROXY.open(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.003)


def start_job(tmp_path: Path, control: TrainerControlCallback) -> tuple[threading.Thread, dict]:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
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
    return train_in_background(trainer, {})


def wait_for(path: Path, thread: threading.Thread) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while not path.is_file():
        assert thread.is_alive() and time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_registries_are_hookloops_then_forgathers_unless_one_is_named(places, tmp_path):
    assert forgather_jobs_dirs() == [places["forgather"], places["forgather_old"]]
    assert registries() == [places["hookloop"], places["forgather"], places["forgather_old"]]
    assert registries(tmp_path / "mine") == [tmp_path / "mine"]


def test_a_job_is_announced_where_forgathers_clients_look_and_gone_at_its_end(places, tmp_path):
    control = TrainerControlCallback(job_id="visible", auth_token="short-tok")
    thread, outcome = start_job(tmp_path, control)
    try:
        endpoint = wait_for(places["forgather_old"] / "visible" / "endpoint.json", thread)
        for name in ("hookloop", "forgather"):
            assert json.loads((places[name] / "visible" / "endpoint.json").read_text()) == endpoint
        for name in places:  # the same token beside each copy, private to this user
            token_file = places[name] / "visible" / "auth_token"
            assert token_file.read_text() == "short-tok"
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        # Forgather's client: endpoint.json's host and port, its token file, "data" bodies
        base = f"http://{endpoint['host']}:{endpoint['port']}"
        job = f"{base}/jobs/visible"
        assert call("GET", f"{job}/status")[0] == 401
        deadline = time.monotonic() + WAIT_S
        while "loss" not in (status := call("GET", f"{job}/status", token="short-tok")[1]):
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert list(status)[:6] == ["job_id", "status", "timestamp", "global_step", "epoch",
                                    "max_steps"]  # fmt: skip
        assert status["status"] == "running" and status["global_step"] >= 5
        code, answer = call(
            "POST", f"{job}/control", {"command": "status", "data": {}}, "short-tok"
        )
        assert code == 200 and answer["status"] == "acknowledged", answer
        # `control list --remote HOST:PORT` sends no token: where each job listens, no more
        code, listing = call("GET", f"{base}/jobs")
        assert code == 200 and listing["jobs"] == [
            {k: endpoint[k] for k in ("job_id", "host", "port", "pid", "started_at")}
        ]
        assert call("GET", f"{base}/jobs", token="wrong-token")[0] == 401
        assert [r.job_id for r in list_jobs()] == ["visible"]  # three copies, one job
        code, answer = call("POST", f"{job}/control", {"command": "graceful_stop", "data": {}},
                            "short-tok")  # fmt: skip
        assert code == 200 and answer["status"] == "acknowledged"
    finally:
        thread.join(WAIT_S)
    assert not thread.is_alive() and outcome["result"].exit_code == 0
    assert not any((places[name] / "visible").exists() for name in places)


def test_an_older_forgather_client_sends_no_token_to_an_auth_disabled_job(places, tmp_path):
    control = TrainerControlCallback("open", None, True, None, None, True)
    with pytest.warns(RuntimeWarning, match="WITHOUT AUTHENTICATION"):
        thread, outcome = start_job(tmp_path, control)
        try:
            job_dir = places["forgather_old"] / "open"
            endpoint = wait_for(job_dir / "endpoint.json", thread)
            assert endpoint["host"] == "127.0.0.1" and not (job_dir / "auth_token").exists()
            job = f"http://127.0.0.1:{endpoint['port']}/jobs/open"
            code, status = call("GET", f"{job}/status")
            assert code == 200 and status["job_id"] == "open" and "global_step" in status
            code, answer = call("POST", f"{job}/control", {"command": "abort", "data": {}})
            assert code == 200 and answer["command"] == "abort"
        finally:
            thread.join(WAIT_S)
    assert outcome["result"].exit_code == 3  # aborted: nothing saved


class _ForgatherJob(http_server.BaseHTTPRequestHandler):
    """What a Forgather trainer's control endpoint answers (its keys, no dashboard)."""

    seen: list[tuple[str, str, Any, str | None]] = []
    token = ""

    def _reply(self, code: int, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _allowed(self) -> bool:
        given = self.headers.get("Authorization")
        if self.token and given != f"Bearer {self.token}":
            self._reply(401, {"detail": "authentication required"})
            return False
        return True

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, None, self.headers.get("Authorization")))
        if self._allowed():
            self._reply(200, {"job_id": self.path.split("/")[2], "status": "running",
                              "timestamp": time.time(), "loss": 0.25, "learning_rate": 1e-3,
                              "global_step": 42, "epoch": 0.5, "max_steps": 100})  # fmt: skip

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("POST", self.path, body, self.headers.get("Authorization")))
        if self._allowed():
            command = body["command"]
            self._reply(200, {"status": "acknowledged", "command": command,
                              "timestamp": time.time(),
                              "message": f"Command {command} queued for execution"})  # fmt: skip

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("where, token", [("forgather_old", ""), ("forgather", "fg-token")])
def test_hookloop_jobs_and_ctl_find_and_steer_a_forgather_job(places, capsys, where, token):
    _ForgatherJob.seen, _ForgatherJob.token = [], token
    server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _ForgatherJob)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}).start()
    try:
        job_dir = places[where] / "job_1_fg_7"
        job_dir.mkdir(parents=True, mode=0o700)
        endpoint = {"job_id": job_dir.name, "host": "127.0.0.1", "pid": os.getpid(),
                    "port": server.server_address[1], "started_at": time.time()}  # fmt: skip
        (job_dir / "endpoint.json").write_text(json.dumps(endpoint))
        if token:
            (job_dir / "auth_token").write_text(token)
        assert main_jobs(["--json"]) == 0
        [row] = json.loads(capsys.readouterr().out)
        assert (row["job_id"], row["step"], row["max_steps"], row["phase"]) == (
            "job_1_fg_7",
            42,
            100,
            "running",
        )
        assert main_ctl(["job_1_fg", "status"]) == 0
        shown = capsys.readouterr().out
        assert f"(pid {os.getpid()}), running" in shown and "step 42 / 100" in shown
        assert "loss 0.25" in shown and "learning_rate 0.001" in shown
        assert main_ctl(["job_1_fg_7", "stop"]) == 0
        assert "Command graceful_stop queued" in capsys.readouterr().out
        sent = {header for *_, header in _ForgatherJob.seen}
        assert sent == ({f"Bearer {token}"} if token else {None})
        assert _ForgatherJob.seen[-1][2] == {"command": "graceful_stop"}
    finally:
        server.shutdown()
        server.server_close()
    # hookloop leaves Forgather's own entries to `forgather control cleanup`
    assert (job_dir / "endpoint.json").exists()


def test_a_forgather_job_that_refuses_shows_its_reason(places, capsys):
    _ForgatherJob.seen, _ForgatherJob.token = [], "needed"
    server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _ForgatherJob)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}).start()
    try:
        job_dir = places["forgather_old"] / "locked"
        job_dir.mkdir(parents=True)
        (job_dir / "endpoint.json").write_text(json.dumps({
            "job_id": "locked", "host": "127.0.0.1", "port": server.server_address[1],
            "pid": os.getpid(), "started_at": 1.0}))  # fmt: skip
        assert main_ctl(["locked", "status"]) == 1
        assert "HTTP 401: authentication required" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_dead_entries_hookloop_wrote_are_cleaned_everywhere_forgathers_are_left(places):
    dead_pid = 2**22 + 12345  # above any pid_max Linux allows by default
    for name, owner in (("hookloop", "0.1"), ("forgather", "0.1"), ("forgather_old", None)):
        job_dir = places[name] / f"dead-{name}"
        job_dir.mkdir(parents=True)
        endpoint = {"job_id": job_dir.name, "host": "127.0.0.1", "port": 9, "pid": dead_pid,
                    "started_at": 1.0, "hookloop": owner}  # fmt: skip
        (job_dir / "endpoint.json").write_text(json.dumps(endpoint))
    assert list_jobs() == []
    assert not (places["hookloop"] / "dead-hookloop").exists()
    assert not (places["forgather"] / "dead-forgather").exists()  # hookloop's own mirror
    assert (places["forgather_old"] / "dead-forgather_old").exists()


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ({"port": 0}, "a port lies in [1, 65535]"),
        ({"port": 70000}, "a port lies in [1, 65535]"),
        ({"pid": -1}, "a pid is positive"),
        ({"port": "x"}, "incomplete"),
    ],
)
def test_a_bad_endpoint_is_named(tmp_path, endpoint, why):
    job_dir = tmp_path / "j"
    job_dir.mkdir()
    data = {"job_id": "j", "host": "127.0.0.1", "port": 8900, "pid": 1, "started_at": 1.0}
    (job_dir / "endpoint.json").write_text(json.dumps(data | endpoint))
    with pytest.raises(ValueError, match=re.escape(why)):
        JobRecord.load(job_dir)


@pytest.mark.parametrize("content, why", [(b"two words", "spaces"), (b"\xff\xfe", "not ASCII"),
                                          (b"  \n", "empty")])  # fmt: skip
def test_a_bad_token_file_is_named(tmp_path, content, why):
    job_dir = tmp_path / "j"
    job_dir.mkdir()
    endpoint = {"job_id": "j", "host": "127.0.0.1", "port": 8900, "pid": 1, "started_at": 1.0}
    (job_dir / "endpoint.json").write_text(json.dumps(endpoint))
    (job_dir / "auth_token").write_bytes(content)
    with pytest.raises(RegistryError, match=why):
        JobRecord.load(job_dir).read_token()


def test_forgathers_command_bodies_are_read_and_checked():
    assert "status" in COMMANDS
    assert parse_request(b'{"command": "save_checkpoint", "data": {}}') == ("save_checkpoint", {})
    assert parse_request(b'{"command": "status"}') == ("status", {})
    for body, why in [
        (b'{"command": "abort", "data": [1]}', '"data" must be a JSON object'),
        (b'{"command": "abort", "data": {"now": 1}}', "abort takes no value 'now'"),
        (b'{"command": "abort", "data": {}, "values": {}}', 'as "values" or as "data", not both'),
    ]:
        with pytest.raises(CommandError, match=why):
            parse_request(body)


def test_train_config_serves_without_auth_on_loopback_only(tmp_path):
    from hookloop.app.cli import _callbacks
    from hookloop.config import Config
    from hookloop.control import ControlServer

    cfg = Config()
    cfg.control.disable_auth = True
    cfg.control.validate()
    [server] = [c for c in _callbacks(cfg, tmp_path, {}) if isinstance(c, ControlServer)]
    assert server.disable_auth is True and server.host == "127.0.0.1"
    cfg.control.host = "0.0.0.0"
    with pytest.raises(ValueError, match=r"control\.allow_remote_without_auth=true"):
        cfg.control.validate()
    cfg.control.allow_remote_without_auth = True
    cfg.control.validate()
    cfg.control.disable_auth = "yes"
    with pytest.raises(ValueError, match=r"control\.disable_auth must be true or false"):
        cfg.control.validate()
