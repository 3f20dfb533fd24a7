"""Who may speak for a DiLoCo worker id, and how far one submission may move the model.

Each attack is first shown working where the server has nothing to tell the attacker
from the worker (an unbound id, the update bound off), then refused where it has.
127.0.0.1 only (and 127.0.0.2 as a second address); every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
import torch

from hookloop.app.cli import main as cli_main
from hookloop.diloco.callback import DiLoCoCallback
from hookloop.diloco.client import ServerRefused
from hookloop.diloco.membership import SECRET_HEADER
from hookloop.diloco.server import DiLoCoServer
from hookloop.diloco.wire import load_tensors, pack
from hookloop.diloco.worker import DiLoCoWorker
from hookloop.testing import TinyModel
from test_diloco_server import (
    TOKEN,
    _both,
    _client,
    _fit,
    _model_server,
    _refused,
    _server,
    _step,
)


def _nan(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(v, float("nan")) for n, v in like.items()}


class ForgatherPeer:
    """Requests as Forgather's client sends them: no token, no worker secret, no binding
    header; from ``source`` (a loopback address) so a test can play a second machine."""

    def __init__(self, address: str, source: str = "127.0.0.1") -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.source = host, int(port), source

    def post(self, route: str, body: bytes, content_type: str) -> tuple[int, bytes, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=20,
                                          source_address=(self.source, 0))  # fmt: skip
        try:
            conn.request("POST", route, body, {"Content-Type": content_type})
            reply = conn.getresponse()
            return reply.status, reply.read(), dict(reply.getheaders())
        finally:
            conn.close()

    def register(self, worker_id: str) -> tuple[int, bytes, dict]:
        body = json.dumps({"worker_id": worker_id, "hostname": "forgather-box"}).encode()
        return self.post("/register", body, "application/json")

    def submit(self, worker_id: str, grads: dict[str, torch.Tensor]) -> tuple[int, bytes, dict]:
        return self.post("/submit_pseudograd", pack({"worker_id": worker_id}, grads),
                         "application/octet-stream")  # fmt: skip

    def heartbeat(self, worker_id: str) -> int:
        body = json.dumps({"worker_id": worker_id, "steps_per_second": 1.0}).encode()
        return self.post("/heartbeat", body, "application/json")[0]


def _error(reply: tuple[int, bytes, dict]) -> str:
    return json.loads(reply[1])["error"]


# -- worker ids bound to their secret ---------------------------------------------------------
def test_three_bad_submissions_under_a_victims_id_evict_an_unbound_one_but_not_a_bound_one(
    tmp_path,
):
    # The attack, where the server cannot tell the attacker from the victim: an id
    # registered without a secret (a Forgather worker), the attacker on the same address.
    open_srv = _server(tmp_path / "open", token=None, disable_auth=True,
                       allow_unbound_workers=True)  # fmt: skip
    try:
        victim, attacker = ForgatherPeer(open_srv.address), ForgatherPeer(open_srv.address)
        status, _, headers = victim.register("victim")
        assert status == 200 and headers[SECRET_HEADER]  # issued; Forgather's worker ignores it
        nan = _nan(_client(open_srv).get_global_params())
        for _ in range(3):
            assert attacker.submit("victim", nan)[0] == 400
        assert victim.heartbeat("victim") == 409  # evicted for good by someone else
    finally:
        open_srv.stop()
    # The same attack on a hookloop worker: its id is bound to its secret.
    srv = _server(tmp_path / "bound")
    try:
        victim, attacker = _client(srv), _client(srv)
        start = victim.register("victim")
        assert SECRET_HEADER not in json.dumps(victim.get_status())  # /status never shows it
        for _ in range(3):
            err = _refused(lambda: attacker.submit_pseudogradients("victim", _nan(start)))
            assert err.status == 403 and "sends no X-Worker-Secret" in str(err)
            assert "\n" not in str(err)
        attacker.secrets["victim"] = "a-guessed-secret"  # a wrong secret fares no better
        for call in (lambda: attacker.submit_pseudogradients("victim", _nan(start)),
                     lambda: attacker.heartbeat("victim"),
                     lambda: attacker.deregister("victim")):  # fmt: skip
            err = _refused(call)
            assert err.status == 403 and "wrong X-Worker-Secret for worker victim" in str(err)
        # Registering the victim's id again would hand the attacker a secret: refused too.
        err = _refused(lambda: _client(srv).register("victim"))
        assert err.status == 403 and "held by a running worker" in str(err)
        assert list(victim.get_status()["workers"]) == ["victim"]
        assert victim.heartbeat("victim")["status"] == "ok"
        new = victim.submit_pseudogradients("victim", {n: torch.ones(4, 4) for n in start})
        for n in start:  # its own round, unharmed: w - 0.7 * 1.9 * g
            torch.testing.assert_close(new[n], start[n] - 0.7 * 1.9)
        assert srv.roster.refusals == {}  # nothing was counted against the victim
    finally:
        srv.stop()


def test_a_submission_under_an_unregistered_id_is_refused_and_closes_no_round(tmp_path):
    sgd = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731 - the plain mean
    srv = _server(tmp_path, outer_optimizer_factory=sgd)
    try:
        a, b, ghost = _client(srv), _client(srv), _client(srv)
        start = a.register("a")
        b.register("b")
        twos = {n: torch.full((4, 4), 2.0) for n in start}
        # Before: the ghost's submission sat in the round and, with a's, closed it without b.
        err = _refused(lambda: ghost.submit_pseudogradients("ghost", twos))
        assert err.status == 404 and "worker ghost is not registered" in str(err)
        assert "\n" not in str(err)
        assert ghost.get_status()["pending_submissions"] == [] and srv.status()["sync_round"] == 0
        assert _refused(lambda: ghost.heartbeat("ghost")).status == 404
        na, nb = _both([
            lambda: a.submit_pseudogradients("a", {n: torch.full((4, 4), 1.0) for n in start}),
            lambda: b.submit_pseudogradients("b", {n: torch.full((4, 4), 3.0) for n in start}),
        ])  # fmt: skip
        for n in start:  # the mean of a and b only: (1 + 3) / 2
            torch.testing.assert_close(na[n], start[n] - 2.0)
            assert torch.equal(na[n], nb[n])
        assert a.get_status()["sync_round"] == 1
    finally:
        srv.stop()


def test_num_workers_is_the_expected_count_not_a_barrier_as_in_forgather(tmp_path, capsys):
    _server(tmp_path).stop()  # writes the start checkpoint
    srv = DiLoCoServer(str(tmp_path / "out3"), 3, str(tmp_path / "start"), port=0, token=TOKEN,
                       save_every_n_rounds=0).start()  # fmt: skip
    try:
        client = _client(srv)
        start = client.register("only")
        assert client.get_status()["num_workers"] == 3
        # -n 3 with one worker registered: the round is that worker's, at once.
        new = client.submit_pseudogradients("only", {n: torch.zeros(4, 4) for n in start})
        assert set(new) == set(start) and client.get_status()["sync_round"] == 1
    finally:
        srv.stop()
    with pytest.raises(SystemExit):
        cli_main(["diloco", "serve", "--help"])
    assert "Not a barrier, as in Forgather" in " ".join(capsys.readouterr().out.split())


# -- workers that send no secret (Forgather's) ------------------------------------------------
def test_a_worker_without_a_secret_needs_allow_unbound_workers_and_its_own_address(tmp_path):
    closed = _server(tmp_path / "closed", token=None, disable_auth=True)
    try:
        reply = ForgatherPeer(closed.address).register("fg")
        assert reply[0] == 403 and "--allow-unbound-workers" in _error(reply)
        assert closed.status()["num_registered"] == 0
    finally:
        closed.stop()
    srv = _server(tmp_path / "open", token=None, disable_auth=True, allow_unbound_workers=True)
    try:
        forgather = ForgatherPeer(srv.address)
        elsewhere = ForgatherPeer(srv.address, source="127.0.0.2")
        status, body, _ = forgather.register("fg")
        assert status == 200
        start = load_tensors(body)
        assert forgather.heartbeat("fg") == 200
        # The same id from another machine: no secret, another address.
        reply = elsewhere.submit("fg", _nan(start))
        assert reply[0] == 403 and "registered from another address" in _error(reply)
        assert elsewhere.register("fg")[0] == 403 and elsewhere.heartbeat("fg") == 403
        # hookloop's worker on the same server stays bound to its secret, even from its address.
        hook = _client(srv, token=None)
        hook.register("hk")
        assert srv.roster.workers["hk"].bound and not srv.roster.workers["fg"].bound
        reply = forgather.submit("hk", _nan(start))
        assert reply[0] == 403 and "bound to a secret" in _error(reply)
        ones = {n: torch.ones(4, 4) for n in start}
        done = _both([lambda: forgather.submit("fg", ones),
                          lambda: hook.submit_pseudogradients("hk", ones)])  # fmt: skip
        assert done[0][0] == 200 and set(done[1]) == set(start)
        assert srv.status()["sync_round"] == 1
    finally:
        srv.stop()


def test_a_hookloop_worker_sends_its_secret_and_registers_again_when_the_server_forgot_it(
    tmp_path,
):
    srv = _model_server(tmp_path)
    try:
        model = TinyModel(seed=2)
        worker = DiLoCoWorker(model, srv.address, sync_every=2, worker_id="w", bf16_comm=False,
                              heartbeat_interval=0, token=TOKEN)  # fmt: skip
        worker.start()
        assert worker.client.secrets["w"] == srv.secret_of("w")
        assert worker._beat_client.secrets is worker.client.secrets
        assert worker._beat_client.heartbeat("w")["status"] == "ok"
        _client(srv).control("kick_worker", {"worker_id": "w"})  # the server forgets it
        for _ in range(2):
            _step(model)
            worker.after_step()
        assert worker.reconnections == 1 and worker.sync_count == 1
        assert srv.status()["sync_round"] == 1 and list(srv.status()["workers"]) == ["w"]
        worker.stop()
        assert srv.status()["num_registered"] == 0
    finally:
        srv.stop()


def test_a_run_resumed_while_its_old_id_is_held_joins_under_a_new_one(tmp_path, caplog):
    srv = _model_server(tmp_path)
    try:

        def worker(worker_id=None):
            return DiLoCoCallback(srv.address, 2, worker_id, False, heartbeat_interval=0,
                                  token=TOKEN)  # fmt: skip

        first = worker()
        _fit(first, tmp_path / "run", steps=4)
        old_id = first.state_dict()["worker_id"]
        holder = _client(srv)
        holder.register(old_id)  # as if the crashed run's registration were still there
        kept = []

        def leave_once_the_resumed_run_joined() -> None:  # or the round waits for it
            for _ in range(600):
                if holder.get_status()["num_registered"] >= 2:
                    break
                time.sleep(0.05)
            kept.append(srv.secret_of(old_id) == holder.secrets[old_id])
            holder.deregister(old_id)

        leaving = threading.Thread(target=leave_once_the_resumed_run_joined)
        leaving.start()
        resumed = worker()
        _, logs = _fit(resumed, tmp_path / "run", steps=8, resume="auto")
        leaving.join(30)
        assert [log["diloco/sync_count"] for log in logs] == [3, 4]  # the counters go on
        new_id = resumed.state_dict()["worker_id"]
        assert new_id != old_id and kept == [True]  # the holder's registration was untouched
        assert any(f"joining as {new_id} instead" in r.message for r in caplog.records)
        # An id given explicitly is never swapped for another: the refusal stops the run.
        holder.register(old_id)
        with pytest.raises(Exception, match=r"403 .*held by a running worker"):
            _fit(worker(old_id), tmp_path / "explicit", steps=2)
    finally:
        srv.stop()


# -- the bound on one update -----------------------------------------------------------------
def test_a_diverged_worker_is_refused_and_the_honest_workers_round_closes(tmp_path, caplog):
    g = torch.Generator().manual_seed(3)
    honest = [{f"layer{i}.weight": 0.05 * torch.randn(4, 4, generator=g) for i in range(3)}
              for _ in range(2)]  # fmt: skip
    huge = {n: torch.full((4, 4), 1e6) for n in honest[0]}  # finite, within MAX_ABS_VALUE

    def round_of_three(srv, *, refused: bool):
        clients = [_client(srv) for _ in range(3)]
        starts = [c.register(f"w{i}") for i, c in enumerate(clients)]  # all three, first
        calls = [lambda c=c, i=i: c.submit_pseudogradients(f"w{i}", honest[i])
                 for i, c in enumerate(clients[:2])]  # fmt: skip
        diverged = lambda: clients[2].submit_pseudogradients("w2", huge)  # noqa: E731
        calls.append((lambda: _refused(diverged)) if refused else diverged)
        return starts[0], _both(calls)

    # The attack, with the bound off: every other check passes and the weights jump to ~1e6.
    off = _server(tmp_path / "off", max_update_ratio=0)
    try:
        _, out = round_of_three(off, refused=False)
        assert max(float(v.abs().max()) for v in out[0].values()) > 1e5
    finally:
        off.stop()
    srv = _server(tmp_path / "on")
    try:
        start, out = round_of_three(srv, refused=True)
        refusal = out[2]
        assert isinstance(refusal, ServerRefused) and refusal.status == 400
        assert "norm is" in str(refusal) and "at most 10 x (max_update_ratio)" in str(refusal)
        assert "\n" not in str(refusal)
        mean = {n: (honest[0][n] + honest[1][n]) / 2 for n in start}
        for n in start:  # the honest pair alone: w - 0.7 * 1.9 * mean
            assert torch.isfinite(out[0][n]).all() and torch.equal(out[0][n], out[1][n])
            torch.testing.assert_close(out[0][n], start[n] - 0.7 * 1.9 * mean[n])
        assert srv.status()["sync_round"] == 1
        assert any("max_update_ratio" in r.message and "w2" in r.message for r in caplog.records)
    finally:
        srv.stop()


@pytest.mark.parametrize("ratio", [-1.0, float("nan"), "10"])
def test_a_bad_max_update_ratio_is_refused_with_what_is_allowed(tmp_path, ratio):
    with pytest.raises(ValueError, match=r"max_update_ratio must be a number >= 0"):
        _server(tmp_path, max_update_ratio=ratio)
