"""DiLoCo across machines in Forgather's protocol: server, client, worker, callback
(127.0.0.1 only; every wait is bounded)."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from hookloop.app.cli import main as cli_main
from hookloop.diloco import storage
from hookloop.diloco.callback import DiLoCoCallback
from hookloop.diloco.client import DiLoCoClient, ServerRefused, ServerUnavailable
from hookloop.diloco.server import DiLoCoServer
from hookloop.diloco.wire import fragment_due, pack, split_fragments, unpack
from hookloop.diloco.worker import DiLoCoWorker
from hookloop.testing import TinyModel

JOB = str(Path(__file__).with_name("_diloco_job.py"))
TOKEN = "diloco-test-token-0123456789"


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(4, 4, generator=g) for i in range(3)}


def _server(tmp_path: Path, weights=None, **kwargs) -> DiLoCoServer:
    start = tmp_path / "start"
    if not storage.is_checkpoint(start):
        start.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        save_file(weights or _weights(), start / storage.SAFE_WEIGHTS)
    settings = {"port": 0, "token": TOKEN, "save_every_n_rounds": 0, **kwargs}
    return DiLoCoServer(str(tmp_path / "out"), 1, str(start), **settings).start()


@pytest.fixture
def server(tmp_path):
    srv = _server(tmp_path)
    yield srv
    srv.stop()


def _client(srv: DiLoCoServer, **kwargs) -> DiLoCoClient:
    return DiLoCoClient(srv.address, **{"timeout": 20, "token": TOKEN, **kwargs})


# -- settings and encoding ------------------------------------------------------------
def test_the_callback_reads_the_environment_keeps_the_address_and_is_idle_without_one(
    monkeypatch,
):
    for name in ("DILOCO_SERVER", "DILOCO_SYNC_EVERY", "DILOCO_HEARTBEAT_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    idle = DiLoCoCallback()
    assert not idle.active and idle.sync_every == 500 and idle.bf16_comm is True
    assert idle.state_dict() == {}
    monkeypatch.setenv("DILOCO_SERVER", "127.0.0.1:9")
    monkeypatch.setenv("DILOCO_HEARTBEAT_INTERVAL", "0")  # 0: no heartbeats, as Forgather
    configured = DiLoCoCallback(sync_every=2, num_fragments=4)
    assert configured.server_addr == "127.0.0.1:9"  # as given, not turned into a URL
    assert configured.heartbeat_interval == 0.0 and configured.num_fragments == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server_addr": "nowhere"}, "server_addr must be 'host:port'"),
        ({"sync_every": 0}, "sync_every must be an int >= 1"),
        ({"heartbeat_interval": -1}, r"heartbeat_interval must be 0 \(no heartbeats\) or"),
        ({"heartbeat_interval": 1e9}, r"seconds in \(0, 3600\]"),
        ({"bf16_comm": "yes"}, "bf16_comm must be True or False"),
    ],
)
def test_bad_worker_settings_are_refused_with_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiLoCoCallback(**{"server_addr": "127.0.0.1:9", **kwargs})


def test_a_submission_is_a_length_prefixed_header_and_a_weights_only_state_dict():
    body = pack({"worker_id": "w", "fragment_id": 1}, {"a": torch.ones(2)})
    assert struct.unpack("!I", body[:4])[0] == len(b'{"worker_id": "w", "fragment_id": 1}')
    header, tensors = unpack(body)
    assert header == {"worker_id": "w", "fragment_id": 1} and torch.equal(
        tensors["a"], torch.ones(2)
    )
    buf = io.BytesIO()
    torch.save({"a": torch.ones(1), "run": print}, buf)  # a callable: not weights-only
    head = b'{"worker_id": "w"}'
    with pytest.raises(ValueError, match=r"not a torch.save'd state dict"):
        unpack(struct.pack("!I", len(head)) + head + buf.getvalue())
    with pytest.raises(ValueError, match=r"header length 999 is more than the body holds"):
        unpack(struct.pack("!I", 999) + b"{}")


def test_fragments_are_cut_by_tensor_count_and_sent_in_turn_as_forgather_does():
    names = [f"p{i}" for i in range(7)]
    assert split_fragments(names, 3) == [["p0", "p1", "p2"], ["p3", "p4"], ["p5", "p6"]]
    with pytest.raises(ValueError, match=r"num_fragments \(8\) is more than the model's 7"):
        split_fragments(names, 8)
    assert [fragment_due(s, 600, 3) for s in (200, 400, 600, 300)] == [0, 1, 2, None]


def test_the_server_starts_from_a_sharded_checkpoint_or_names_what_is_missing(tmp_path):
    from safetensors.torch import save_file

    weights = _weights()
    ckpt = tmp_path / "sharded"
    ckpt.mkdir()
    names = list(weights)
    save_file({n: weights[n] for n in names[:2]}, ckpt / "model-00001-of-00002.safetensors")
    save_file({names[2]: weights[names[2]]}, ckpt / "model-00002-of-00002.safetensors")
    weight_map = {
        n: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, n in enumerate(names)
    }
    (ckpt / storage.SAFE_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    srv = DiLoCoServer(str(tmp_path / "out"), 2, str(ckpt), port=0, disable_auth=True)
    assert all(torch.equal(srv.get_global_params()[n], weights[n]) for n in names)
    with pytest.raises(ValueError, match=r"no checkpoint in .*pass from_checkpoint="):
        DiLoCoServer(str(tmp_path / "empty"), 1)
    with pytest.raises(ValueError, match=r"needs token= .* or disable_auth=True"):
        DiLoCoServer(str(tmp_path / "out"), 1, str(ckpt), port=0).start()
    remote = DiLoCoServer(str(tmp_path / "out"), 1, str(ckpt), 0, host="0.0.0.0", disable_auth=True)
    with pytest.raises(ValueError, match=r"allow_remote_without_auth=True"):
        remote.start()


# -- the protocol over HTTP ----------------------------------------------------------------
def test_tokens_unreachable_servers_and_unknown_routes_are_named(server):
    with pytest.raises(ServerRefused, match=r"401.*Bearer"):
        DiLoCoClient(server.address, token="not-the-token-at-all").get_status()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ServerUnavailable, match=f"127.0.0.1:{closed} unreachable"):
        DiLoCoClient(f"127.0.0.1:{closed}", timeout=2).get_status()
    with pytest.raises(
        ServerRefused, match=r"404 .*Unknown endpoint: /v1/join.*routes: POST /register"
    ):
        _client(server)._json("POST", "v1/join", {})


def test_register_status_and_a_round_as_forgather_computes_them(server):
    client = _client(server)
    got = client.register("w0", {"hostname": "box"})
    assert all(
        torch.equal(got[n], w) and got[n].dtype == torch.float32 for n, w in _weights().items()
    )
    status = client.get_status()
    assert status["mode"] == "sync" and status["sync_round"] == 0 and status["num_registered"] == 1
    assert status["workers"]["w0"]["hostname"] == "box"
    assert {"pending_submissions", "uptime_seconds", "heartbeat_timeout", "min_workers",
            "outer_lr", "outer_momentum", "save_dir", "model_params", "model_size_mb",
            "dashboard_enabled"} <= set(status)  # fmt: skip
    grads = {n: torch.ones(4, 4) for n in got}
    new = client.submit_pseudogradients("w0", grads)
    # Nesterov SGD, lr 0.7, momentum 0.9, first step: w - 0.7 * (1 + 0.9) * g
    for n in got:
        torch.testing.assert_close(new[n], got[n] - 0.7 * 1.9)
    assert client.heartbeat("w0", 3.0)["sync_round"] == 1
    assert client.get_status()["workers"]["w0"]["sync_round"] == 1


def test_a_bad_contribution_is_refused_with_the_reason(server):
    client = _client(server)
    good = {n: torch.zeros(4, 4) for n in _weights()}
    sparse = torch.zeros(4, 4).to_sparse()
    cases = [
        ({**good, "extra.weight": torch.zeros(1)}, "parameter name mismatch.*unexpected 1"),
        ({**good, "layer0.weight": torch.zeros(4, 5)}, r"layer0.weight has shape \(4, 5\)"),
        ({**good, "layer1.weight": torch.full((4, 4), float("nan"))}, "16 NaN or infinite"),
        ({**good, "layer1.weight": torch.full((4, 4), float("-inf"))}, "NaN or infinite"),
        ({**good, "layer2.weight": torch.full((4, 4), 10**18)}, "dtype torch.int64; allowed"),
        ({**good, "layer2.weight": torch.ones(4, 4, dtype=torch.complex64)}, "complex64"),
        ({**good, "layer2.weight": torch.full((4, 4), 1e30)}, "magnitude 1e.30; allowed: at"),
        ({**good, "layer2.weight": sparse}, "sparse_coo tensor; send a dense"),
    ]
    before = client.get_global_params()
    for i, (grads, reason) in enumerate(cases):
        client.register(f"w{i}")  # a new worker each time: three refusals evict one
        buf = io.BytesIO()
        torch.save(grads, buf)  # as sent, sparse included
        head = json.dumps({"worker_id": f"w{i}"}).encode()
        body = struct.pack("!I", len(head)) + head + buf.getvalue()
        with pytest.raises(ServerRefused, match=f"400.*{reason}") as refused:
            client._call("POST", "submit_pseudograd", body, "application/octet-stream",
                         worker_id=f"w{i}")  # with the worker's secret  # fmt: skip
        assert "\n" not in str(refused.value)
    with pytest.raises(ServerRefused, match=r"400.*fragment_id must be an int"):
        client.submit_fragment_pseudogradients("w0", -1, {"layer0.weight": torch.zeros(4, 4)})
    assert client.get_status()["sync_round"] == 0  # nothing was applied
    after = client.get_global_params()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_repeated_offender_sits_out_then_is_evicted_and_answered_409(tmp_path):
    srv = _server(tmp_path, heartbeat_timeout=0.3)
    try:
        honest, bad = _client(srv), _client(srv)
        start = honest.register("honest")
        bad.register("bad", {"heartbeat_interval": 1e9})  # the server keeps its own timeout
        nan = {n: torch.full((4, 4), float("nan")) for n in start}
        ones = {n: torch.ones(4, 4) for n in start}
        # The honest worker waits at the barrier; the refused one sits the round out.
        new, refusal = _both([
            lambda: honest.submit_pseudogradients("honest", ones),
            lambda: (time.sleep(0.1), _refused(lambda: bad.submit_pseudogradients("bad", nan)))[1],
        ])  # fmt: skip
        assert refusal.status == 400 and "NaN" in str(refusal)
        for n in start:  # the honest contribution alone: w - 0.7 * 1.9 * g
            torch.testing.assert_close(new[n], start[n] - 0.7 * 1.9)
        for _ in range(2):
            assert _refused(lambda: bad.submit_pseudogradients("bad", nan)).status in (400, 409)
        for call in (lambda: bad.submit_pseudogradients("bad", ones),
                     lambda: bad.register("bad"), lambda: bad.heartbeat("bad")):  # fmt: skip
            err = _refused(call)
            assert err.status == 409 and "evicted after 3 refused contributions" in str(err)
        status = honest.get_status()
        assert list(status["workers"]) == ["honest"] and status["sync_round"] == 1
        again = honest.submit_pseudogradients("honest", {n: torch.zeros(4, 4) for n in start})
        assert set(again) == set(start)  # the next round is the honest worker's alone
    finally:
        srv.stop()


def _refused(call) -> ServerRefused:
    with pytest.raises(ServerRefused) as caught:
        call()
    return caught.value


class _FailsOnce(torch.optim.SGD):
    failures = 1

    def step(self, closure=None):
        super().step(closure)  # half done, then it breaks: the server must undo it
        if _FailsOnce.failures:
            _FailsOnce.failures -= 1
            raise RuntimeError("injected failure")


def test_a_failing_outer_step_answers_every_worker_and_leaves_the_weights(tmp_path):
    srv = _server(tmp_path, outer_optimizer_factory=lambda p: _FailsOnce(p, lr=1.0, momentum=0.9))
    try:
        a, b = _client(srv, max_retries=0), _client(srv, max_retries=0)
        start = a.register("a")
        b.register("b")
        ones = {n: torch.ones(4, 4) for n in start}
        errors = _both([
            lambda: _unavailable(lambda: a.submit_pseudogradients("a", ones)),
            lambda: _unavailable(lambda: b.submit_pseudogradients("b", ones)),
        ])  # fmt: skip
        for err in errors:
            assert "500" in err and "injected failure" in err and "unchanged" in err
        now = a.get_global_params()
        assert all(torch.equal(now[n], start[n]) for n in start)
        assert srv.outer_optimizer.state_dict()["state"] == {}  # no momentum was kept
        # Fragments that name other parameters than the round's first are refused, not wedged.
        frag = {"layer0.weight": torch.ones(4, 4)}
        other = {"layer1.weight": torch.ones(4, 4)}
        done, refusal = _both([
            lambda: a.submit_fragment_pseudogradients("a", 0, frag),
            lambda: (time.sleep(0.1),
                     _refused(lambda: b.submit_fragment_pseudogradients("b", 0, other)))[1],
        ])  # fmt: skip
        assert "every worker must cut the model into the same fragments" in str(refusal)
        torch.testing.assert_close(done["layer0.weight"], start["layer0.weight"] - 1.0)
        new = _both([lambda: a.submit_pseudogradients("a", ones),
                     lambda: b.submit_pseudogradients("b", ones)])  # fmt: skip
        assert torch.equal(new[0]["layer1.weight"], new[1]["layer1.weight"])
        assert a.get_status()["sync_round"] == 2
    finally:
        srv.stop()


def _unavailable(call) -> str:
    with pytest.raises(ServerUnavailable) as caught:
        call()
    return str(caught.value)


def test_a_failed_save_keeps_the_previous_checkpoint_and_the_rounds_go_on(tmp_path, monkeypatch):
    import errno

    srv = _server(tmp_path, save_every_n_rounds=1)
    try:
        client = _client(srv)
        start = client.register("w")
        ones = {n: torch.ones(4, 4) for n in start}
        client.submit_pseudogradients("w", ones)
        saved = tmp_path / "out" / "checkpoints" / "checkpoint-1"
        first = (saved / storage.SAFE_WEIGHTS).read_bytes()
        real = storage.save_file

        def full_disk(tensors, path, *args, **kwargs):
            real(tensors, path, *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(storage, "save_file", full_disk)
        second = client.submit_pseudogradients("w", ones)  # answered although the save failed
        assert client.control("save_state")  # nothing new to save? it is dirty: it fails...
    except ServerUnavailable as err:
        assert "500" in str(err) and "No space left on device" in str(err)
        monkeypatch.setattr(storage, "save_file", real)
        checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
        assert checkpoints == ["checkpoint-1"]  # no torn checkpoint-2, no staging left
        assert (saved / storage.SAFE_WEIGHTS).read_bytes() == first
        third = client.submit_pseudogradients("w", ones)  # and the next round saves again
        assert set(third) == set(second)
        names = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
        assert names == ["checkpoint-1", "checkpoint-3"]
    else:
        raise AssertionError("save_state on a full disk must answer 500")
    finally:
        srv.stop()
    # A damaged newest checkpoint is passed over, naming it: the server starts from the older.
    data = (tmp_path / "out" / "checkpoints" / "checkpoint-3" / storage.SERVER_STATE).read_bytes()
    (tmp_path / "out" / "checkpoints" / "checkpoint-3" / storage.SERVER_STATE).write_bytes(
        data[: len(data) // 2]
    )
    again = DiLoCoServer(str(tmp_path / "out"), 1, port=0, token=TOKEN)
    assert again.status()["sync_round"] == 1


def test_the_body_cap_is_settable_and_refuses_in_one_line(tmp_path):
    srv = _server(tmp_path, max_payload_mb=1)
    try:
        client = _client(srv)
        client.register("w")
        big = {n: torch.zeros(4, 4) for n in _weights()} | {"pad": torch.zeros(2**19)}
        err = _refused(lambda: client.submit_pseudogradients("w", big))
        assert err.status == 413 and "cap of 1 MB" in str(err) and "--max-payload-mb" in str(err)
    finally:
        srv.stop()
    auto = _server(tmp_path)
    auto.stop()
    assert auto.max_payload_mb == 64 + 1  # 48 float64 values round up to 1 MB, plus 64


def test_the_server_refuses_a_file_as_output_dir_and_names_a_missing_certificate(tmp_path):
    (tmp_path / "afile").write_text("x")
    start = tmp_path / "start"
    start.mkdir()
    from safetensors.torch import save_file

    save_file(_weights(), start / storage.SAFE_WEIGHTS)
    with pytest.raises(NotADirectoryError, match=r"afile is a file; give a directory"):
        DiLoCoServer(str(tmp_path / "afile"), 1, str(start), token=TOKEN)
    with pytest.raises(FileNotFoundError, match=r"certfile .*nocert.pem does not exist"):
        DiLoCoServer(str(tmp_path / "out"), 1, str(start), token=TOKEN,
                     certfile=str(tmp_path / "nocert.pem"), keyfile=str(start))  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"cafile .*noca.pem does not exist"):
        DiLoCoClient("https://127.0.0.1:1", cafile=str(tmp_path / "noca.pem"))


def test_admin_routes_and_dashboard(server):
    client = _client(server)
    client.register("w0")
    assert client.control("update_optimizer", {"lr": 0.5}) == {"status": "ok", "lr": 0.5}
    with pytest.raises(ServerRefused, match=r"400.*No parameters to update"):
        client.control("update_optimizer", {})
    with pytest.raises(ServerRefused, match=r"400.*momentum must be a number in \[0, 1\)"):
        client.control("update_optimizer", {"momentum": 2})
    assert client.control("update_num_workers", {"num_workers": 3})["num_workers"] == 3
    with pytest.raises(ServerRefused, match=r"404.*Worker nobody not found"):
        client.control("kick_worker", {"worker_id": "nobody"})
    assert client.control("kick_worker", {"worker_id": "w0"})["worker_id"] == "w0"
    with pytest.raises(ServerRefused, match=r"404.*Unknown control action: reboot"):
        client.control("reboot")
    status = client.get_status()
    assert status["num_registered"] == 0 and status["total_worker_deaths"] == 1
    assert status["outer_lr"] == 0.5
    req = urllib.request.Request(f"http://{server.address}/dashboard")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=10) as page:
        assert b"<title>DiLoCo Dashboard</title>" in page.read()


def test_the_outer_optimizer_is_set_from_the_command_line_and_each_change_recorded(server, capsys):
    setter = ["diloco", "set", "--server", server.address, "--token", TOKEN]
    assert cli_main([*setter, "lr=0.25", "momentum=0.5"]) == 0
    assert "outer optimizer now lr 0.25, momentum 0.5" in capsys.readouterr().out
    assert cli_main([*setter, "momentum=2"]) == 2  # refused by the server: nothing changes
    assert "momentum must be a number in [0, 1)" in capsys.readouterr().err
    assert cli_main([*setter, "beta=0.1"]) == 2
    status = _client(server).get_status()
    assert (status["outer_lr"], status["outer_momentum"]) == (0.25, 0.5)
    lines = (Path(server.output_dir) / "changes.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["changes"] == [
        {"key": "lr", "old": 0.7, "new": 0.25}, {"key": "momentum", "old": 0.9, "new": 0.5},
    ]  # fmt: skip
    assert record["client"].startswith("hookloop ctl (")


def _both(calls) -> list:
    """Run the calls at once (a sync barrier needs every worker inside it)."""
    out: list = [None] * len(calls)

    def run(i: int) -> None:
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_two_workers_meet_at_the_barrier_and_fragments_have_their_own(tmp_path):
    sgd = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731 - plain mean, Forgather's test
    srv = _server(tmp_path, outer_optimizer_factory=sgd)
    try:
        a, b = _client(srv), _client(srv)
        start = a.register("a")
        b.register("b")
        ga = {n: torch.full((4, 4), 1.0) for n in start}
        gb = {n: torch.full((4, 4), 3.0) for n in start}
        na, nb = _both([lambda: a.submit_pseudogradients("a", ga),
                        lambda: b.submit_pseudogradients("b", gb)])  # fmt: skip
        for n in start:
            assert torch.equal(na[n], nb[n])
            torch.testing.assert_close(na[n], start[n] - 2.0)
        one = {"layer0.weight": torch.ones(4, 4)}
        fa, fb = _both([lambda: a.submit_fragment_pseudogradients("a", 0, one),
                        lambda: b.submit_fragment_pseudogradients("b", 0, one)])  # fmt: skip
        assert set(fa) == {"layer0.weight"} and torch.equal(
            fa["layer0.weight"], fb["layer0.weight"]
        )
        now = a.get_global_params()
        torch.testing.assert_close(now["layer0.weight"], na["layer0.weight"] - 1.0)
        assert torch.equal(now["layer1.weight"], na["layer1.weight"])  # untouched
        status = a.get_status()
        assert status["sync_round"] == 2 and status["fragment_submissions"] == 2
    finally:
        srv.stop()


def test_a_silent_worker_is_evicted_and_the_barrier_lets_the_others_go(tmp_path):
    srv = _server(tmp_path, heartbeat_timeout=0.3)
    try:
        a, b = _client(srv), _client(srv)
        start = a.register("a")
        b.register("b")  # and then never heard from again
        done = threading.Event()

        def beat() -> None:  # a real worker's heartbeat thread keeps beating while it waits
            beats = _client(srv)
            beats.secrets = a.secrets  # with a's secret, as a worker's two clients share it
            while not done.wait(0.05):
                beats.heartbeat("a", 1.0)

        beating = threading.Thread(target=beat)
        beating.start()
        try:
            new = a.submit_pseudogradients("a", {n: torch.zeros(4, 4) for n in start})
        finally:
            done.set()
            beating.join(5)
        assert set(new) == set(start)
        status = a.get_status()
        assert list(status["workers"]) == ["a"] and status["total_worker_deaths"] == 1
    finally:
        srv.stop()


def test_async_with_delayed_nesterov_and_dylu(tmp_path):
    srv = _server(tmp_path, async_mode=True, dn_buffer_size=2, dylu_enabled=True,
                  dylu_base_sync_every=100)  # fmt: skip
    try:
        fast, slow = _client(srv), _client(srv)
        start = fast.register("fast")
        slow.register("slow")
        g = {n: torch.ones(4, 4) for n in start}
        first = fast.submit_pseudogradients("fast", g)  # buffered: plain lr * g, no barrier
        for n in start:
            torch.testing.assert_close(first[n], start[n] - 0.7)
        second = fast.submit_pseudogradients("fast", g)  # buffer full: momentum step on the mean
        for n in start:
            torch.testing.assert_close(second[n], first[n] - 0.7 * 1.9)
        fast.heartbeat("fast", 10.0)
        assert slow.heartbeat("slow", 2.5)["recommended_sync_every"] == 25
        status = fast.get_status()
        assert status["mode"] == "async" and status["total_submissions"] == 2
        assert status["dn_buffered"] == 0 and status["dylu_base_sync_every"] == 100
    finally:
        srv.stop()


def test_a_restarted_server_continues_with_its_round_and_momentum(tmp_path):
    srv = _server(tmp_path, save_every_n_rounds=1)
    client = _client(srv)
    start = client.register("a")
    g = {n: torch.ones(4, 4) for n in start}
    after = client.submit_pseudogradients("a", g)
    srv.stop()
    saved = tmp_path / "out" / "checkpoints" / "checkpoint-1"
    assert (saved / "model.safetensors").is_file() and (saved / "server_state.pt").is_file()
    again = DiLoCoServer(str(tmp_path / "out"), 1, port=0, token=TOKEN).start()
    try:
        client = _client(again)
        assert client.get_status()["sync_round"] == 1
        assert all(torch.equal(v, after[n]) for n, v in client.register("a").items())
        second = client.submit_pseudogradients("a", g)
        # with the saved momentum the second Nesterov step moves 0.7 * (1 + 0.9 * 1.9)
        for n in start:
            torch.testing.assert_close(after[n] - second[n], torch.full((4, 4), 0.7 * 2.71))
    finally:
        again.stop()


def test_a_tokenless_peer_is_admitted_on_loopback_when_told(tmp_path, capsys):
    srv = _server(tmp_path, token=None, disable_auth=True)
    try:
        assert "WITHOUT AUTHENTICATION (loopback only)" in capsys.readouterr().err
        assert DiLoCoClient(srv.address).get_status()["status"] == "running"
    finally:
        srv.stop()


# -- workers and the callback ----------------------------------------------------------------
def _model_server(tmp_path: Path, **kwargs) -> DiLoCoServer:
    storage.save_initial(tmp_path / "start", TinyModel(seed=1))
    return _server(tmp_path, **kwargs)


def _step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01)


def test_a_streaming_worker_syncs_one_fragment_at_a_time(tmp_path):
    srv = _model_server(tmp_path)
    try:
        model = TinyModel(seed=2)
        worker = DiLoCoWorker(model, srv.address, sync_every=4, worker_id="s", bf16_comm=False,
                              heartbeat_interval=0, num_fragments=2, token=TOKEN)  # fmt: skip
        worker.start()
        start = srv.get_global_params()
        assert all(torch.equal(p.detach(), start[n]) for n, p in model.named_parameters())
        for _ in range(4):
            _step(model)
            worker.after_step()
        worker.stop()
        metrics = worker.sync_metrics
        assert metrics["diloco/fragment_syncs"] == 2 and metrics["diloco/num_fragments"] == 2
        assert metrics["diloco/sync_count"] == 1 and metrics["diloco/last_send_mb"] > 0
        assert srv.status()["fragment_submissions"] == 2 and srv.status()["num_registered"] == 0
    finally:
        srv.stop()


def test_a_streaming_worker_refused_by_the_server_stops_instead_of_training_alone(tmp_path):
    srv = _model_server(tmp_path)
    try:
        model = TinyModel(seed=2)
        worker = DiLoCoWorker(model, srv.address, sync_every=4, worker_id="s", bf16_comm=False,
                              heartbeat_interval=0, num_fragments=2, token=TOKEN)  # fmt: skip
        worker.start()
        srv.roster.evicted["s"] = "an earlier NaN"  # as after three refused contributions
        with pytest.raises(ServerRefused, match=r"409 .*worker s was evicted"):
            for _ in range(4):
                _step(model)
                worker.after_step()
        worker.stop()
    finally:
        srv.stop()


def _fit(callback, out_dir, steps: int, resume=None):
    from hookloop import CallbackManager, Config, DataConfig, TrainConfig, Trainer
    from hookloop.testing import ToyData

    logs: list[dict] = []
    manager = CallbackManager(callback)
    manager.register("on_log", lambda ctx: logs.append(dict(ctx.logs)), priority=200)
    cfg = Config(train=TrainConfig(max_steps=steps, log_every=2), data=DataConfig(batch_size=4))
    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=64), loss_fn=TinyModel.loss_fn, config=cfg,
        callbacks=manager, out_dir=str(out_dir), resume=resume,
    )  # fmt: skip
    trainer.train()
    return trainer, logs


def test_the_callback_logs_forgathers_metrics_and_resumes_its_counters_and_id(tmp_path):
    srv = _model_server(tmp_path)
    try:

        def worker():
            return DiLoCoCallback(srv.address, 2, None, False, heartbeat_interval=0, token=TOKEN)

        _, logs = _fit(worker(), tmp_path / "run", steps=4)
        assert [log["diloco/sync_count"] for log in logs] == [1, 2]
        assert {"diloco/last_send_mb", "diloco/last_recv_mb", "diloco/local_step",
                "diloco/steps_per_second"} <= set(logs[-1])  # fmt: skip
        saved = torch.load(
            tmp_path / "run" / "checkpoints" / "step-00000004" / "trainer_state.pt",
            weights_only=True,
        )["callbacks"]["DiLoCoCallback"]
        assert saved["sync_count"] == 2 and saved["sync_every"] == 2
        resumed = worker()
        trainer, logs = _fit(resumed, tmp_path / "run", steps=8, resume="auto")
        assert [log["diloco/sync_count"] for log in logs] == [3, 4]
        assert resumed.state_dict()["worker_id"] == saved["worker_id"]
        assert srv.status()["sync_round"] == 4 and srv.status()["num_registered"] == 0
        final = srv.get_global_params()
        for name, param in trainer.model.named_parameters():
            assert torch.equal(param.detach(), final[name])
    finally:
        srv.stop()


def test_serve_refuses_bad_settings_with_what_is_allowed(tmp_path, capsys):
    out = ["diloco", "serve", "-o", str(tmp_path), "-n", "1", "--port", "0"]
    assert (
        cli_main([*out, "--no-auth", "--recipe", "mlp-regression", "--outer-momentum", "1.5"]) == 2
    )
    assert "outer_momentum must be a number in [0, 1" in capsys.readouterr().err
    assert cli_main(out) == 2
    assert "needs --token T (or DILOCO_TOKEN) or --no-auth" in capsys.readouterr().err
    assert cli_main([*out, "--no-auth"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_a_certificate_and_key(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    srv = _server(tmp_path, certfile=str(cert), keyfile=str(key))
    try:
        url = f"https://{srv.address}"
        assert DiLoCoClient(url, token=TOKEN, cafile=str(cert)).get_status()["sync_round"] == 0
        with pytest.raises(ServerUnavailable, match=r"CERTIFICATE_VERIFY_FAILED"):
            DiLoCoClient(url, token=TOKEN, timeout=5).get_status()  # not trusted
    finally:
        srv.stop()


# -- separate processes ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, out: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hookloop", "diloco", "serve", "-o", str(out), "-n", "2",
           "--port", str(port), "--token", TOKEN, "--save-every", "1", "--outer-momentum", "0.5",
           "--heartbeat-timeout", "30", "--recipe", "mlp-regression"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))


def _worker(out: Path, index: int, port: int, *overrides: str, sleep: float = 0):
    env = {**os.environ, "DILOCO_TOKEN": TOKEN, "DILOCO_SLEEP": str(sleep)}
    cmd = [sys.executable, JOB, "worker", str(out), str(index), "2", f"127.0.0.1:{port}",
           *overrides]  # fmt: skip
    log = (out / f"worker-{index}.log").open("ab")
    return zygote.Popen(cmd, stdout=log, stderr=log, env=env, cwd=str(out))


def _round(port: int) -> int | None:
    try:
        return DiLoCoClient(f"127.0.0.1:{port}", token=TOKEN, timeout=2).get_status()["sync_round"]
    except (ServerUnavailable, ServerRefused):
        return None


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _mean_loss(result: dict, first: bool) -> float:
    ordered = [v for _, v in sorted(result["losses"].items(), key=lambda kv: int(kv[0]))]
    values = ordered[:4] if first else ordered[-4:]
    return sum(values) / len(values)


@pytest.mark.slow
def test_a_killed_server_restarted_on_its_output_dir_lets_two_workers_finish(tmp_path):
    port = _free_port()
    server = _serve(port, tmp_path / "server", tmp_path / "server.log")
    procs = []
    try:
        _wait_for(lambda: _round(port) is not None, 60, "the server to listen")
        procs = [_worker(tmp_path, i, port, "train.max_steps=40", sleep=0.05) for i in range(2)]
        _wait_for(lambda: (_round(port) or 0) >= 3, 60, "three rounds")
        before = _round(port)
        server.kill()
        server.wait()
        server = _serve(port, tmp_path / "server", tmp_path / "server.log")
        _wait_for(lambda: _round(port) is not None, 60, "the restarted server")
        assert _round(port) >= before - 1  # it continued from its last checkpoint
        results = []
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=120) == 0, (tmp_path / f"worker-{i}.log").read_text()[-3000:]
            results.append(json.loads((tmp_path / f"result-worker-{i}.json").read_text()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=10)
    assert [r["step"] for r in results] == [40, 40]
    assert sum(r["metrics"].get("diloco/reconnections", 0) for r in results) >= 1
    assert "continuing from" in (tmp_path / "server.log").read_text()
    for r in results:
        assert _mean_loss(r, first=False) < 0.5 * _mean_loss(r, first=True)


def test_one_worker_sending_nan_is_refused_and_the_others_train_on(tmp_path, caplog):
    """Three real workers, one of which turns its weights to NaN before every sync: its
    pseudo-gradient is refused, it stops, and the other two finish with a lower loss.

    Deterministic, so the loss ratio holds under any load: the start model is the one the
    recipe's seed builds, and every worker joins before any trains (tests/_diloco_job.py),
    so each round averages the same two workers."""
    from hookloop.recipes import default_config, get_recipe

    cfg = default_config("mlp-regression")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = get_recipe("mlp-regression").build(cfg).model
    start = storage.save_initial(tmp_path / "start", model)
    srv = DiLoCoServer(str(tmp_path / "out"), 3, str(start), port=0, token=TOKEN,
                       outer_momentum=0.5, save_every_n_rounds=0)  # fmt: skip
    srv.start()
    procs = []
    try:
        for i in range(3):
            env = {**os.environ, "DILOCO_TOKEN": TOKEN, "DILOCO_POISON": "nan" if i == 2 else ""}
            log = (tmp_path / f"worker-{i}.log").open("ab")
            cmd = [sys.executable, JOB, "worker", str(tmp_path), str(i), "3", srv.address,
                   "train.max_steps=24"]  # fmt: skip
            procs.append(zygote.Popen(cmd, stdout=log, stderr=log, env=env, cwd=str(tmp_path)))
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        srv.stop()
    logs = [(tmp_path / f"worker-{i}.log").read_text() for i in range(3)]
    assert codes[:2] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert codes[2] != 0 and "answered 400" in logs[2] and "NaN or infinite" in logs[2]
    results = [json.loads((tmp_path / f"result-worker-{i}.json").read_text()) for i in range(2)]
    for r in results:
        assert r["step"] == 24 and r["metrics"]["diloco/sync_count"] == 6
        first, last = _mean_loss(r, first=True), _mean_loss(r, first=False)
        assert math.isfinite(last) and last < 0.8 * first, (first, last)
    final = srv.get_global_params()
    assert all(bool(torch.isfinite(v).all()) for v in final.values())
    assert srv.status()["sync_round"] == 6  # everyone joined first: one round per sync
    assert any("refused (1/3)" in r.message for r in caplog.records)
