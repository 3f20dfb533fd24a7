"""Pausing and resuming a DiLoCo server's outer loop while its workers train on locally.

Real servers on 127.0.0.1 and hookloop's real workers (:class:`DiLoCoWorker`) on small
models, stepped by hand so every phase counts steps and rounds. Each worker runs with
``max_sync_retries=0`` and ``max_missed_syncs=1``: a paused answer taken for a failure
would stop it at its first paused sync. One worker trains under DDP on two ranks
(tests/_diloco_job.py); one server runs as ``hookloop diloco serve`` to take a SIGTERM.
Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from _dist_launch import torchrun
from hookloop.app.cli import main as cli_main
from hookloop.diloco import storage
from hookloop.diloco.client import DiLoCoClient, ServerPaused, ServerRefused
from hookloop.diloco.server import DiLoCoServer
from hookloop.diloco.worker import DiLoCoWorker
from hookloop.errors import ConfigError
from hookloop.testing import TinyModel
from test_diloco_server import (
    JOB,
    TOKEN,
    _both,
    _client,
    _free_port,
    _model_server,
    _round,
    _server,
    _step,
    _wait_for,
)

#: Runs ``hookloop ARGV`` here, then prints its exit code and the heavy modules it imported.
PROBE = """
import json, sys
from hookloop.app.cli import main
code = main(sys.argv[1:])
heavy = [m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "aiohttp")]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _plain_mean(params):
    """An outer step of lr 1 without momentum: the new weights are the old minus the mean
    pseudo-gradient, so a test can say exactly which local steps a round merged."""
    return torch.optim.SGD(params, lr=1.0)


def _worker(srv: DiLoCoServer, name: str, **kwargs) -> DiLoCoWorker:
    settings = {"sync_every": 2, "bf16_comm": False, "heartbeat_interval": 0,
                "max_sync_retries": 0, "max_missed_syncs": 1, **kwargs}  # fmt: skip
    worker = DiLoCoWorker(TinyModel(seed=7), srv.address, worker_id=name, token=TOKEN, **settings)
    worker.start()
    return worker


def _train(workers: list[DiLoCoWorker], steps: int) -> list[int]:
    """``steps`` local steps on every worker at once (a barrier needs them all); the steps
    each one took."""

    def run(worker: DiLoCoWorker) -> int:
        taken = 0
        for _ in range(steps):
            _step(worker.model)
            worker.after_step()
            taken += 1
        return taken

    return _both([lambda w=w: run(w) for w in workers])


def _cli(srv: DiLoCoServer, action: str, *token: str) -> list[str]:
    return ["diloco", action, "--server", srv.address, *(token or ("--token", TOKEN))]


def _events(srv: DiLoCoServer) -> list[dict]:
    path = Path(srv.output_dir) / "changes.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if "event" in r]


def test_paused_rounds_stop_while_two_workers_train_on_and_merge_all_their_steps_on_resume(
    tmp_path, capsys
):
    srv = _model_server(tmp_path, outer_optimizer_factory=_plain_mean)
    workers = [_worker(srv, "a"), _worker(srv, "b")]
    try:
        assert _train(workers, 4) == [4, 4] and srv.status()["sync_round"] == 2
        start = srv.get_global_params()
        assert cli_main(_cli(srv, "pause")) == 0
        assert "outer loop paused at round 2" in capsys.readouterr().out

        assert _train(workers, 6) == [6, 6]  # three sync points each, every one answered paused
        status = srv.status()
        assert status["sync_round"] == 2 and status["paused"] is True
        assert status["paused_by"].startswith("hookloop ctl (") and status["paused_since"] > 0
        assert status["num_registered"] == 2
        for worker in workers:
            assert worker.active and worker.missed_syncs == 0 and worker.paused_syncs == 3
            assert worker.sync_metrics["diloco/paused_syncs"] == 3
            for name, param in worker.model.named_parameters():  # trained on from its own
                torch.testing.assert_close(param.detach(), start[name] - 0.06)
        now = srv.get_global_params()
        assert all(torch.equal(now[name], start[name]) for name in start)  # no outer step

        assert cli_main(_cli(srv, "resume")) == 0
        assert "outer loop resumed at round 2" in capsys.readouterr().out
        assert _train(workers, 2) == [2, 2] and srv.status()["sync_round"] == 3
        merged = srv.get_global_params()
        for name in start:  # each pseudo-gradient covered its 8 steps since round 2
            torch.testing.assert_close(merged[name], start[name] - 0.08)
        for worker in workers:
            assert worker.missed_syncs == 0 and worker.paused_syncs == 3
            for name, param in worker.model.named_parameters():
                assert torch.equal(param.detach(), merged[name])
    finally:
        for worker in workers:
            worker.stop()
        srv.stop()
    assert [(e["event"], e["sync_round"]) for e in _events(srv)] == [
        ("pause", 2), ("resume", 2)
    ]  # fmt: skip


def test_a_pause_answers_the_workers_waiting_at_the_barrier_and_says_its_state(tmp_path, capsys):
    srv = _server(tmp_path, outer_optimizer_factory=_plain_mean)
    try:
        a, b = _client(srv), _client(srv)
        start = a.register("a")
        b.register("b")
        ones = {name: torch.ones_like(value) for name, value in start.items()}
        waited: list[BaseException] = []

        def submit_a() -> None:
            try:
                a.submit_pseudogradients("a", ones)
            except ServerPaused as err:
                waited.append(err)

        thread = threading.Thread(target=submit_a)
        thread.start()
        _wait_for(lambda: srv.status()["pending_submissions"] == ["a"], 30, "a at the barrier")
        answer = a.control("pause", {"client": "operator"})
        assert answer["paused"] is True and answer["released_waiting"] == 1
        thread.join(timeout=30)
        assert len(waited) == 1 and waited[0].by == "operator"
        assert "answered 503 to /submit_pseudograd" in str(waited[0])
        with pytest.raises(ServerPaused, match=r"outer loop is paused .* at round 0"):
            b.submit_pseudogradients("b", ones)
        assert srv.status()["pending_submissions"] == []

        assert cli_main(_cli(srv, "pause")) == 2  # already paused: nothing changes
        err = capsys.readouterr().err
        assert "409" in err and "already paused" in err and "by operator" in err
        assert len(err.strip().splitlines()) == 1
        a.control("resume")
        with pytest.raises(ServerRefused, match=r"409 .*resume: the outer loop is not paused"):
            a.control("resume")
        with pytest.raises(ServerRefused, match=r"400 .*client"):
            a.control("pause", {"client": ["me"]})

        twos = {name: 2 * value for name, value in ones.items()}
        _both([lambda: a.submit_pseudogradients("a", ones),
               lambda: b.submit_pseudogradients("b", twos)])  # fmt: skip
        assert srv.status()["sync_round"] == 1  # a's dropped submission is not in it
        merged = srv.get_global_params()
        for name in start:
            torch.testing.assert_close(merged[name], start[name] - 1.5)
    finally:
        srv.stop()
    assert [e["client"] for e in _events(srv)] == ["operator", "unknown"]


def test_an_async_server_takes_no_submission_while_paused(tmp_path):
    srv = _server(tmp_path, async_mode=True)
    try:
        client = _client(srv)
        start = client.register("a")
        ones = {name: torch.ones_like(value) for name, value in start.items()}
        client.control("pause")
        with pytest.raises(ServerPaused):
            client.submit_pseudogradients("a", ones)
        with pytest.raises(ServerPaused):
            client.submit_fragment_pseudogradients("a", 0, {"layer0.weight": ones["layer0.weight"]})
        status = srv.status()
        assert status["sync_round"] == 0 and status["total_submissions"] == 0
        assert all(torch.equal(v, start[n]) for n, v in srv.get_global_params().items())
        assert client.heartbeat("a")["paused"] is True
        client.control("resume")
        client.submit_pseudogradients("a", ones)
        assert srv.status()["sync_round"] == 1 and client.heartbeat("a")["paused"] is False
    finally:
        srv.stop()


def test_pause_and_resume_need_the_token_and_the_command_imports_no_torch(server, capsys):
    for token in (None, "wrong-token-0123456789"):
        anonymous = DiLoCoClient(server.address, timeout=10, token=token)
        with pytest.raises(ServerRefused, match=r"401 .*missing or wrong token"):
            anonymous.control("pause", {"client": "intruder"})
    assert cli_main(_cli(server, "pause", "--token", "wrong-token-0123456789")) == 2
    assert "401" in capsys.readouterr().err
    assert server.status()["paused"] is False and _events(server) == []

    probe = subprocess.run(
        [sys.executable, "-c", PROBE, *_cli(server, "pause")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    report = json.loads(probe.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "heavy": []}, probe.stderr[-2000:]
    assert "outer loop paused at round 0" in probe.stdout
    assert server.status()["paused"] is True

    with pytest.raises(ServerRefused, match=r"401"):
        DiLoCoClient(server.address, timeout=10).control("resume")
    assert server.status()["paused"] is True and len(_events(server)) == 1


def test_a_streaming_worker_sends_its_fragments_into_a_pause_and_trains_on(tmp_path):
    srv = _model_server(tmp_path)
    worker = _worker(srv, "s", sync_every=4, num_fragments=2)
    try:
        _client(srv).control("pause")
        for _ in range(8):  # four fragments sent, each answered paused
            _step(worker.model)
            worker.after_step()
        worker.finish_in_flight()
        assert worker.missed_syncs == 0 and worker.paused_syncs == 4
        assert worker.fragment_syncs == 0 and srv.status()["sync_round"] == 0
        _client(srv).control("resume")
        for _ in range(4):
            _step(worker.model)
            worker.after_step()
        worker.finish_in_flight()
        assert worker.fragment_syncs == 2 and srv.status()["sync_round"] == 2
    finally:
        worker.stop()
        srv.stop()


def test_a_ddp_worker_agrees_on_every_rank_that_a_paused_sync_is_not_missed(tmp_path):
    """Two ranks, rank 0 talking to a paused server: without the paused answer shared,
    rank 1 would count three missed syncs and stop (max_missed_syncs is 3)."""
    from hookloop.recipes import default_config, get_recipe

    cfg = default_config("mlp-regression")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        start = storage.save_initial(tmp_path / "start", get_recipe(cfg.recipe).build(cfg).model)
    srv = DiLoCoServer(str(tmp_path / "out"), 1, str(start), port=0, token=TOKEN,
                       save_every_n_rounds=0).start()  # fmt: skip
    try:
        _client(srv).control("pause")
        cmd = [*torchrun(2), JOB, "ddp", str(tmp_path), "0", "1", srv.address]
        env = {**os.environ, "DILOCO_TOKEN": TOKEN}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        assert srv.status()["sync_round"] == 0 and srv.status()["paused"] is True
    finally:
        srv.stop()
    result = json.loads((tmp_path / "result-ddp-0.json").read_text())
    assert result["step"] == 12 and result["metrics"]["diloco/paused_syncs"] == 3


def test_sigterm_while_paused_saves_exits_143_and_a_restarted_server_stays_paused(tmp_path):
    start = storage.save_initial(tmp_path / "start", TinyModel(seed=1))
    out, port = tmp_path / "out", _free_port()
    cmd = [sys.executable, "-m", "hookloop", "diloco", "serve", "-o", str(out), "-n", "1",
           "--port", str(port), "--token", TOKEN, "--save-every", "10",
           "--from-checkpoint", str(start)]  # fmt: skip
    log = tmp_path / "server.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    try:
        _wait_for(lambda: _round(port) is not None, 60, "the server to listen")
        client = DiLoCoClient(f"127.0.0.1:{port}", timeout=20, token=TOKEN)
        weights = client.register("w")
        step = {name: torch.full_like(value, 0.01) for name, value in weights.items()}
        client.submit_pseudogradients("w", step)  # round 1, not saved yet (every 10)
        client.control("pause", {"client": "operator"})
        with pytest.raises(ServerPaused):
            client.submit_pseudogradients("w", step)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped by SIGTERM at round 1 (exit 143)" in log.read_text()
    assert [p.name for p in storage.saved_rounds(out)] == ["checkpoint-1"]  # saved on the signal

    srv = DiLoCoServer(str(out), 1, port=0, token=TOKEN, save_every_n_rounds=0).start()
    try:
        status = srv.status()
        assert (status["sync_round"], status["paused"], status["paused_by"]) == (
            1,
            True,
            "operator",
        )
        client = _client(srv)
        client.register("w")
        with pytest.raises(ServerPaused):
            client.submit_pseudogradients("w", step)
        client.control("resume")
        client.submit_pseudogradients("w", step)
        assert srv.status()["sync_round"] == 2 and srv.status()["paused"] is False
    finally:
        srv.stop()


@pytest.mark.timeout(240, func_only=True)
def test_the_dashboards_buttons_pause_and_resume_and_show_who_paused_as_text(tmp_path):
    from test_control_dashboard import MS, _browser, _find_chromium, _watch

    chromium = _find_chromium()
    if chromium is None:  # tests/test_control_dashboard.py installs it
        pytest.skip("no chromium: HOOKLOOP_CHROMIUM, /usr/bin/chromium or on PATH")

    srv = _server(tmp_path)
    hostile = "<img src=x onerror=window.pwned=1>"
    try:
        client = _client(srv)
        client.control("pause", {"client": hostile})  # a name that is markup
        with _browser(tmp_path, chromium) as context:
            naive = context.new_page()  # the name runs as markup where it is not text
            naive.set_content(f"<p>{hostile}</p>")
            naive.wait_for_function("() => window.pwned === 1", timeout=MS)
            naive.close()
            page = context.new_page()
            problems, _ = _watch(page)
            page.goto(f"http://{srv.address}/dashboard", timeout=MS)
            page.fill("#tok", TOKEN)
            page.press("#tok", "Tab")
            shown = "() => document.getElementById('paused').textContent"
            page.wait_for_function(f"{shown}.includes('PAUSED')", timeout=MS)
            assert page.text_content("#paused").endswith(
                f"by {hostile}: no round advances, workers train on locally"
            )
            assert page.evaluate("() => window.pwned === undefined")
            assert page.locator("#paused img").count() == 0
            page.click("#resume")
            page.wait_for_function(f"{shown} === 'outer loop running'", timeout=MS)
            assert client.get_status()["paused"] is False
            page.click("#pause")
            page.wait_for_function(f"{shown}.endsWith('by dashboard: no round advances, "
                                   "workers train on locally')", timeout=MS)  # fmt: skip
            assert client.get_status()["paused_by"] == "dashboard"
        assert problems == [], problems
    finally:
        srv.stop()
    assert [e["client"] for e in _events(srv)] == [hostile, "dashboard", "dashboard"]


@pytest.fixture
def server(tmp_path):
    srv = _server(tmp_path)
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    ("tamper", "problem"),
    [
        ("edit", "edited after it was written"),
        ("append", "added by hand"),
        ("drop", "a record was removed, reordered"),
    ],
)
def test_a_journal_changed_by_hand_stops_the_server_at_start(tmp_path, tamper, problem):
    """Before the journal was chained, an operator's "pause" turned into "resume" by hand
    (or a "resume" line appended) unpaused a restarted server with no trace."""
    srv = _server(tmp_path)
    client = _client(srv)
    client.control("pause", {"client": "operator"})
    client.control("resume", {"client": "operator"})
    client.control("pause", {"client": "operator"})
    srv.stop()
    path = Path(srv.output_dir) / "changes.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all("prev" in r and "hash" in r for r in records)  # chained as written
    if tamper == "edit":
        records[-1]["event"] = "resume"
    elif tamper == "append":
        records.append({"event": "resume", "sync_round": 0, "client": "x", "time": 0.0})
    else:
        del records[1]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ConfigError) as refused:
        DiLoCoServer(srv.output_dir, 1, str(tmp_path / "start"), port=0, token=TOKEN)
    message = str(refused.value)
    assert problem in message and "changes.jsonl:" in message and "\n" not in message
    assert "move changes.jsonl aside" in message


def test_a_journal_written_before_chaining_is_read_with_a_warning(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    legacy = {"event": "pause", "sync_round": 0, "client": "operator", "time": 1.0}
    (out / "changes.jsonl").write_text(json.dumps(legacy) + "\n")
    srv = _server(tmp_path)
    try:
        assert srv.status()["paused"] is True and srv.status()["paused_by"] == "operator"
        _client(srv).control("resume", {"client": "operator"})
    finally:
        srv.stop()
    assert "1 record(s) written before the journal was chained" in caplog.text
    lines = (out / "changes.jsonl").read_text().splitlines()
    assert "prev" not in json.loads(lines[0]) and "prev" in json.loads(lines[1])
