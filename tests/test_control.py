"""The control server, job registry, client and CLI: pure parts in-process, and real
HTTP against real training processes (tests/_control_job.py), 127.0.0.1 only."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from _control_support import WAIT_S, Job, train_in_background
from hookloop import Callback
from hookloop.control import (
    COMMANDS,
    CommandError,
    ControlServer,
    JobClient,
    JobDir,
    JobRecord,
    TrainerControlCallback,
    find_job,
    jobs_dir,
    list_jobs,
    parse_command,
)
from hookloop.control.cli import main, main_ctl, main_jobs
from hookloop.control.client import ControlError
from hookloop.control.dashboard import CSP, PAGE

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(180)

# ---------------------------------------------------------------------------------
# pure parts
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_parse_command_accepts_each_command(command):
    body = {"command": command}
    if command == "set":  # the one command that needs values
        body["values"] = {"lr": 0.1}
    if command == "unset":  # it names the scheduled change it cancels
        body["values"] = {"id": "1"}
    assert parse_command(json.dumps(body).encode()) == command
    assert parse_command(json.dumps({**body, "extra": [1]}).encode()) == command


@pytest.mark.parametrize(
    "body",
    [b"", b"  ", b"{", b"[]", b'"graceful_stop"', b"{}", b'{"cmd": "abort"}', b'{"command": 1}',
     b'{"command": "stop"}', b'{"command": "ABORT"}', b"\xff\xfe", b"[" * 5000],
    ids=lambda b: repr(b[:16]),
)  # fmt: skip
def test_parse_command_rejects_bad_bodies_listing_valid_commands(body):
    with pytest.raises(CommandError) as info:
        parse_command(body)
    assert info.value.status == 400
    for command in COMMANDS:
        assert command in str(info.value)


def test_constructor_validates_and_forgather_name_is_an_alias():
    assert TrainerControlCallback is ControlServer
    with pytest.raises(ValueError, match="job_id"):
        ControlServer(job_id="../etc")
    with pytest.raises(ValueError, match="port"):
        ControlServer(port=70000)
    for bad in ("two words", "tab\there", "caf\u00e9", 42, "x" * 5000):
        with pytest.raises(ValueError, match="auth_token must be a string of printable ASCII"):
            ControlServer(auth_token=bad)
    # Forgather takes any token, short ones too; "" asks for a fresh one, as there
    assert ControlServer(auth_token="short")._fixed_token == "short"
    assert ControlServer(auth_token="")._fixed_token is None
    assert ControlServer(job_id="a.b_c-1", port=None).port == 0


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_token_file_is_0600_even_when_it_existed_with_0644(tmp_path, umask):
    job_dir = JobDir("job-1", tmp_path / "jobs")
    job_dir.create()
    job_dir.token_path.write_text("stale")
    os.chmod(job_dir.token_path, 0o644)
    old = os.umask(umask)
    try:
        path = job_dir.write_token("fresh-token-value")
    finally:
        os.umask(old)
    info = os.lstat(path)
    assert stat.S_ISREG(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert path.read_text() == "fresh-token-value"
    assert stat.S_IMODE(os.stat(job_dir.path).st_mode) == 0o700
    assert sorted(p.name for p in job_dir.path.iterdir()) == ["auth_token"]  # no temp left
    job_dir.remove()
    assert not job_dir.path.exists()


def test_token_never_written_through_a_planted_symlink(tmp_path):
    job_dir = JobDir("job-2", tmp_path / "jobs")
    job_dir.create()
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    job_dir.token_path.symlink_to(target)
    job_dir.write_token("secret-token-value")
    assert target.read_text() == "untouched"
    assert not job_dir.token_path.is_symlink()
    assert stat.S_IMODE(os.lstat(job_dir.token_path).st_mode) == 0o600


def test_jobs_dir_prefers_the_override_then_the_runtime_dir_then_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_JOBS_DIR", str(tmp_path / "override"))
    assert jobs_dir() == tmp_path / "override"
    monkeypatch.delenv("HOOKLOOP_JOBS_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert jobs_dir() == tmp_path / "hookloop" / "jobs"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jobs_dir() == tmp_path / "home" / ".config" / "hookloop" / "jobs"


def _register(base: Path, job_id: str, pid: int, started: float = 1.0) -> JobDir:
    job_dir = JobDir(job_id, base)
    job_dir.create()
    job_dir.write_token("t" * 20)
    url = "http://127.0.0.1:9/"
    record = JobRecord(job_id, pid, url, "127.0.0.1", 9, started, dir=job_dir.path)
    job_dir.write_endpoint(record)
    return job_dir


def test_list_jobs_keeps_live_ones_and_removes_dead_ones(tmp_path):
    base = tmp_path / "jobs"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=WAIT_S)
    _register(base, "alive-job", os.getpid(), started=2.0)
    _register(base, "dead-job", dead.pid)
    (base / "half-written").mkdir()  # a job still starting: left alone
    jobs = list_jobs(base)
    assert [j.job_id for j in jobs] == ["alive-job"]
    assert not (base / "dead-job").exists()
    assert (base / "half-written").exists()
    assert jobs[0].token_path.read_text() == "t" * 20


def test_find_job_by_id_prefix_or_pid_and_errors_list_live_jobs(tmp_path):
    base = tmp_path / "jobs"
    _register(base, "alpha-1", os.getpid(), 1.0)
    _register(base, "alpha-2", os.getppid(), 2.0)
    assert find_job("alpha-1", base).job_id == "alpha-1"
    assert find_job(str(os.getppid()), base).job_id == "alpha-2"
    with pytest.raises(LookupError, match="matches 2 jobs"):
        find_job("alpha", base)
    with pytest.raises(LookupError, match="live jobs: alpha-1, alpha-2"):
        find_job("beta", base)
    assert main_ctl(["nope", "status", "--jobs-dir", str(base)]) == 2


def test_dashboard_page_is_self_contained_and_locked_down():
    page = PAGE.decode()
    for needle in ("http://", "https://", "src=", "@import"):
        assert needle not in page.replace("http://www.w3.org/2000/svg", "")
    assert "<form" not in page  # nothing that could submit the token in a query string
    assert "sessionStorage" in page and "Authorization" in page
    assert "script-src 'sha256-" in CSP and "'unsafe-inline'" not in CSP


def test_client_reports_an_unreachable_job(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = JobClient(f"http://127.0.0.1:{port}", "gone", "x" * 20, timeout=2)
    with pytest.raises(ControlError, match="cannot be reached"):
        client.status()
    with pytest.raises(ValueError, match="graceful_stop"):
        client.command("explode")


# ---------------------------------------------------------------------------------
# in-process: a Trainer in a thread
# ---------------------------------------------------------------------------------


class _Gate(Callback):
    """Paces the loop, and holds it inside ``on_train_step_end`` while closed."""

    def __init__(self):
        self.open = threading.Event()
        self.open.set()
        self.held_at = None
        self.held = threading.Event()

    def on_train_step_end(self, ctx):
        time.sleep(0.002)
        if not self.open.is_set():
            self.held_at = ctx.state.step
            self.held.set()
            self.open.wait(WAIT_S)


class _Boom(Callback):
    def on_train_step_end(self, ctx):
        if ctx.state.step == 3:
            raise RuntimeError("boom")


def _wait_serving(server, thread):
    deadline = time.monotonic() + WAIT_S
    while server.record is None:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return server.record


def test_in_process_refusals_status_and_cleanup(tmp_path, make_trainer):
    server = ControlServer(jobs_dir=tmp_path / "jobs", announce=False, required=True)
    gate = _Gate()
    trainer = make_trainer(callbacks=[server, gate], max_steps=10**6, log_every=5)
    thread, outcome = train_in_background(trainer)
    record = _wait_serving(server, thread)
    client = JobClient.from_record(record)
    try:
        for command, why in [
            ("save_checkpoint", "no output directory"),
            ("save_and_stop", "no output directory"),
            ("evaluate_now", "no evaluation data"),
        ]:
            with pytest.raises(ControlError, match=why) as info:
                client.command(command)
            assert info.value.status == 409
        deadline = time.monotonic() + WAIT_S
        while (status := client.status())["steps_per_s"] is None or not status["metrics"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status["max_steps"] == 10**6 and status["step"] > 0
        assert status["eta_s"] > 0 and "loss" in status["metrics"]
        assert status["can_save"] is False and status["can_evaluate"] is False
        gate.open.clear()  # hold the loop inside a step: nothing filed is drained yet
        assert gate.held.wait(WAIT_S)
        answer = client.command("abort")
        assert answer["accepted"] == "abort" and answer["step"] == gate.held_at
        with pytest.raises(ControlError, match="already ending") as info:
            client.command("graceful_stop")
        assert info.value.status == 409
    finally:
        gate.open.set()
        trainer.control.request_abort("test over")
        thread.join(WAIT_S)
    assert trainer.state.step == gate.held_at  # the abort took effect at that step's end
    assert outcome["result"].exit_code == 3
    assert not record.dir.exists()
    # the same callback serves a second fit, under the same job id, with a fresh token
    old_token = server.token
    assert make_trainer(callbacks=[server], max_steps=3).train().step == 3
    assert server.token != old_token and not record.dir.exists()


def test_job_directory_removed_when_training_raises(tmp_path, make_trainer):
    server = ControlServer(jobs_dir=tmp_path / "jobs", announce=False, required=True)
    trainer = make_trainer(callbacks=[server, _Boom()], max_steps=10)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert list((tmp_path / "jobs").iterdir()) == []


def test_non_loopback_bind_warns(tmp_path, make_trainer):
    server = ControlServer(host="0.0.0.0", jobs_dir=tmp_path / "jobs", announce=False)
    trainer = make_trainer(callbacks=[server], max_steps=2)
    with pytest.warns(RuntimeWarning, match="reachable from other machines"):
        trainer.train()


def test_port_in_use_warns_and_trains_on_unless_required(tmp_path, make_trainer):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = ControlServer(port=port, jobs_dir=tmp_path / "jobs", announce=False)
        with pytest.warns(RuntimeWarning, match="not started"):
            result = make_trainer(callbacks=[server], max_steps=3).train()
        assert result.step == 3
        strict = ControlServer(port=port, jobs_dir=tmp_path / "j2", announce=False, required=True)
        with pytest.raises(Exception, match="cannot listen"):
            make_trainer(callbacks=[strict], max_steps=3).train()


# ---------------------------------------------------------------------------------
# real training processes
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Start every process this module needs at once, so their slow starts overlap."""
    root = tmp_path_factory.mktemp("control")
    jobs_dir = root / "jobs"
    jobs = {
        "shared": Job(root / "shared", jobs_dir, "shared-job", sleep=0.01),
        "stop": Job(root / "stop", jobs_dir, "stop-job", sleep=0.01),
        "save_and_stop": Job(root / "sas", jobs_dir, "sas-job", sleep=0.01),
        "abort": Job(root / "abort", jobs_dir, "abort-job", sleep=0.01),
    }
    yield jobs
    for job in jobs.values():
        job.kill()


@pytest.fixture
def shared(fleet):
    job = fleet["shared"].ready()
    assert job.proc.poll() is None, job.stderr()
    return job


def test_auth_401_without_or_with_a_wrong_token_200_with_it(shared):
    for token in ("", "Bearer wrong-token", f"Basic {shared.token}", f"Bearer {shared.token}x",
                  "Bearer \u00e9\u00e9"):  # fmt: skip
        for method, route in [("GET", shared.api("status")), ("GET", "/jobs"),
                              ("POST", shared.api("control")), ("GET", "/nowhere")]:  # fmt: skip
            body = b'{"command": "abort"}' if method == "POST" else None
            headers = {"Authorization": token} if token else {}
            code, answer, got = shared.request(method, route, body, token="", headers=headers)
            if not token and route == "/jobs":
                # no header at all: Forgather's `control list --remote` learns where each job
                # listens, and nothing more
                assert code == 200 and answer["jobs"][0] == {
                    "job_id": "shared-job",
                    "host": "127.0.0.1",
                    "port": shared.record.port,
                    "pid": shared.record.pid,
                    "started_at": shared.record.started,
                }, answer
                continue
            assert code == 401, (token, route, code, answer)
            assert "bearer token" in answer["error"] and got["WWW-Authenticate"].startswith(
                "Bearer"
            )
    code, answer, _ = shared.request("GET", shared.api("status"))
    assert code == 200 and answer["job_id"] == "shared-job" and answer["phase"] == "training"
    assert {"step", "epoch", "max_steps", "metrics", "eta_s", "steps_per_s"} <= set(answer)
    code, answer, _ = shared.request("GET", "/jobs")
    # Forgather's listing: every live job in the jobs directory, this one first (the module's fleet
    # shares one directory, so the others still running are listed too).
    assert code == 200 and answer["jobs"][0]["job_id"] == "shared-job"
    assert {j["job_id"] for j in answer["jobs"]} <= {
        "shared-job",
        "stop-job",
        "sas-job",
        "abort-job",
    }
    assert answer["jobs"][0]["url"] == shared.record.url
    # the page needs no token and holds none
    code, page, got = shared.request("GET", "/", token="")
    assert code == 200 and got["Content-Security-Policy"] == CSP and shared.token not in page
    assert shared.proc.poll() is None


def test_bad_requests_get_4xx_naming_what_is_valid(shared):
    code, answer, _ = shared.request("POST", shared.api("control"), b'{"command": "explode"}')
    assert code == 400 and answer["valid_commands"] == [*COMMANDS, "note"]  # the job added one
    assert "graceful_stop, save_checkpoint, save_and_stop, abort, evaluate_now" in answer["error"]
    code, answer, _ = shared.request("POST", shared.api("control"), b"not json")
    assert code == 400 and "valid commands" in answer["error"].lower()
    code, answer, _ = shared.request("POST", "/jobs/other-job/control", b'{"command": "abort"}')
    assert code == 404 and "shared-job" in answer["error"]
    code, answer, _ = shared.request("GET", "/jobs/other-job/status")
    assert code == 404
    code, answer, got = shared.request("PUT", shared.api("control"), b"{}")
    assert code == 405 and "POST" in got.get("Allow", "")
    code, answer, _ = shared.request("POST", shared.api("control"), b"x" * 100_000)
    assert code == 413
    code, answer, _ = shared.request("GET", shared.api("history?after=abc"))
    assert code == 400
    assert shared.status()["stopping"] is None and shared.proc.poll() is None


def test_save_checkpoint_writes_one_at_the_next_step(shared):
    before = shared.checkpoints()
    filed = shared.command("save_checkpoint")["step"]
    new = shared.wait_for("a checkpoint", lambda: set(shared.checkpoints()) - set(before))
    (name,) = new
    assert shared.checkpoints()[name] in (filed, filed + 1)
    assert shared.wait_for("status", lambda: shared.status()["checkpoint"])["step"] in (
        filed,
        filed + 1,
    )


def test_evaluate_now_runs_an_evaluation_at_the_next_step(shared):
    assert shared.records("eval") == []  # the job evaluates only on request
    filed = shared.command("evaluate_now")["step"]
    (record,) = shared.wait_for("an eval record", lambda: shared.records("eval"))
    assert record["step"] in (filed, filed + 1) and "eval_loss" in record
    status = shared.wait_for("eval in status", lambda: (s := shared.status())["eval"] and s)
    assert status["eval_step"] == record["step"]
    history = shared.request("GET", shared.api("history?after=0"))[1]
    assert any(r["kind"] == "eval" for r in history["records"])

    def train_records() -> list:  # the first log comes at step 10: maybe after the eval
        records = shared.request("GET", shared.api("history?after=0"))[1]["records"]
        return [r for r in records if r["kind"] == "train" and "loss" in r]

    assert shared.wait_for("a train record in the history", train_records)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_near_misses = st.sampled_from(
    [c.upper() for c in COMMANDS] + [c + " " for c in COMMANDS] + [" " + c for c in COMMANDS]
    + ["stop", "save", "eval", "save-and-stop", "graceful-stop", "", "\u0000abort"]
)  # fmt: skip
_bodies = st.one_of(
    st.binary(max_size=200),
    _json_values.map(json.dumps),
    st.dictionaries(st.sampled_from(["command", "cmd", "data"]) | st.text(max_size=8),
                    _json_values, max_size=4).map(json.dumps),
    st.fixed_dictionaries({"command": _near_misses | _json_values}).map(json.dumps),
)  # fmt: skip


def _names_a_valid_command(body):
    try:
        return parse_command(body.encode() if isinstance(body, str) else body) in COMMANDS
    except CommandError:
        return False


def test_fuzzed_requests_never_5xx_and_never_disturb_training(shared):
    start = shared.status()["step"]
    conn = http.client.HTTPConnection("127.0.0.1", shared.port, timeout=WAIT_S)
    seen = set()

    @settings(
        max_examples=100,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        body=_bodies,
        content_type=st.sampled_from(
            ["application/json", "text/plain", "", "application/x-www-form-urlencoded"]
        ),
        after=st.text(max_size=12),
    )
    def probe(body, content_type, after):
        assume(not _names_a_valid_command(body))
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        headers = {"Content-Type": content_type} if content_type else {}
        code, answer, _ = shared.request(
            "POST", shared.api("control"), data, headers=headers, conn=conn
        )
        assert 400 <= code < 500, (code, answer, body)
        seen.add(code)
        query = "history?after=" + "".join(f"%{b:02X}" for b in after.encode("utf-8", "replace"))
        code, answer, _ = shared.request("GET", shared.api(query), conn=conn)
        assert code in (200, 400), (code, answer, after)

    try:
        probe()
    finally:
        conn.close()
    assert seen == {400}
    status = shared.status()
    assert status["stopping"] is None and status["phase"] == "training"
    assert {c["command"] for c in status["recent_commands"]} <= {"save_checkpoint", "evaluate_now"}
    shared.wait_step(start + 20)  # still training
    assert shared.proc.poll() is None


def test_jobs_and_ctl_functions(shared, capsys, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_JOBS_DIR", str(shared.jobs_dir))
    assert main_jobs(["--json"]) == 0
    listed = {j["job_id"]: j for j in json.loads(capsys.readouterr().out)}
    entry = listed["shared-job"]
    assert entry["pid"] == shared.proc.pid and entry["url"] == shared.record.url
    assert isinstance(entry["step"], int) and entry["step"] > 0
    assert main_jobs([]) == 0
    assert "shared-job" in capsys.readouterr().out
    assert main_ctl(["shared", "status"]) == 0
    out = capsys.readouterr().out
    assert "step" in out and "shared-job" in out
    assert main_ctl(["shared-job", "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job_id"] == "shared-job"
    assert main_ctl(["shared-job", "token"]) == 0
    assert capsys.readouterr().out.strip() == shared.token
    assert main(["ctl", str(shared.proc.pid), "url"]) == 0
    assert capsys.readouterr().out.strip() == shared.record.url


def _notes(job) -> list[dict]:
    path = job.out / "notes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_command_the_job_registered_carries_its_values_over_http_and_ctl(
    shared, capsys, monkeypatch
):
    """``note`` (tests/_control_job.py: register_kind, register_action, register_command)
    is a command the job added: it takes a text, is checked before anything is filed,
    and is acted on at the end of the step it was filed in."""
    assert "note" in shared.status()["commands"]
    filed = shared.command("note", {"text": "over http"})["step"]
    (note,) = shared.wait_for("the note", lambda: _notes(shared))
    assert note["text"] == "over http" and note["step"] in (filed, filed + 1)
    for values, why in [
        ({}, "needs the value 'text'"),
        ({"text": "x", "colour": "red"}, "takes no value 'colour'; it takes: text"),
        ({"text": 7}, "text must be a string"),
        ("text", '"values" must be a JSON object'),
    ]:
        code, answer, _ = shared.request(
            "POST",
            shared.api("control"),
            json.dumps({"command": "note", "values": values}).encode(),
        )
        assert code == 400 and why in answer["error"], (values, code, answer)
    code, answer, _ = shared.request(
        "POST", shared.api("control"), json.dumps({"command": "abort", "values": {"x": 1}}).encode()
    )
    assert code == 400 and "abort takes no value 'x'; it takes: none" in answer["error"]
    monkeypatch.setenv("HOOKLOOP_JOBS_DIR", str(shared.jobs_dir))
    assert main_ctl(["shared-job", "note", "text=from ctl"]) == 0
    assert "shared-job: note filed at step" in capsys.readouterr().out
    shared.wait_for("the second note", lambda: len(_notes(shared)) == 2)
    assert [n["text"] for n in _notes(shared)] == ["over http", "from ctl"]
    assert main_ctl(["shared-job", "note", "txt=typo"]) == 2  # refused by the job: HTTP 400
    assert "takes no value 'txt'" in capsys.readouterr().err
    assert main_ctl(["shared-job", "nope"]) == 2
    assert "unknown action 'nope'" in capsys.readouterr().err
    assert main_ctl(["shared-job", "note", "=x"]) == 2
    shared.wait_step(shared.status()["step"] + 3)
    assert len(_notes(shared)) == 2  # nothing refused was filed
    assert shared.status()["stopping"] is None


def test_graceful_stop_saves_and_exits_0(fleet, tmp_path, capsys, monkeypatch):
    job = fleet["stop"].ready()
    monkeypatch.setenv("HOOKLOOP_JOBS_DIR", str(job.jobs_dir))
    job.wait_step(5)
    assert job.checkpoints() == {}
    assert main_ctl(["stop-job", "stop", "--wait", str(WAIT_S)]) == 0
    assert "has exited" in capsys.readouterr().out
    assert job.wait_exit() == 0, job.stderr()
    (step,) = job.checkpoints().values()
    assert f"graceful_stop requested over HTTP at step {step}" in job.stderr()
    assert not (job.jobs_dir / "stop-job").exists()  # token and endpoint removed


def test_save_and_stop_through_the_module_cli(fleet):
    job = fleet["save_and_stop"].ready()
    job.wait_step(5)
    env = dict(os.environ, HOOKLOOP_JOBS_DIR=str(job.jobs_dir))
    done = subprocess.run(
        [sys.executable, "-m", "hookloop.control.cli", "ctl", "sas", "save-and-stop"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "save_and_stop filed at step" in done.stdout
    filed = int(done.stdout.split("filed at step ")[1].split(":")[0])
    assert job.wait_exit() == 0, job.stderr()
    (step,) = job.checkpoints().values()
    assert step in (filed, filed + 1)
    assert "sas-job" not in {j.job_id for j in list_jobs(job.jobs_dir)}


def test_abort_exits_3_without_saving(fleet):
    job = fleet["abort"].ready()
    job.command("save_checkpoint")
    saved = job.wait_for("a checkpoint", job.checkpoints)
    job.wait_step(max(saved.values()) + 5)
    job.command("abort")
    assert job.wait_exit() == 3, job.stderr()
    assert job.checkpoints() == saved  # nothing new
    assert "abort: abort requested over HTTP" in job.stderr()
    assert not (job.jobs_dir / "abort-job").exists()
