"""DiLoCo across machines: the server, its workers, and what they survive (127.0.0.1 only)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import _zygote as zygote
import hookloop.compat.hf as hf
from hookloop.app.cli import main as cli_main
from hookloop.callbacks import DiLoCo
from hookloop.diloco.callback import DiLoCoCallback
from hookloop.diloco.client import DiLoCoClient, ServerRefused, ServerUnavailable
from hookloop.diloco.server import ServerSettings, ServerThread
from hookloop.diloco.wire import split_fragments
from hookloop.diloco.worker import DiLoCoWorker

JOB = str(Path(__file__).with_name("_diloco_job.py"))
TOKEN = "diloco-test-token-0123456789"


# -- in one process ----------------------------------------------------------------------
def test_without_a_server_the_seed_callback_does_nothing_and_reads_the_environment(
    monkeypatch,
):
    for name in ("DILOCO_SERVER", "DILOCO_SYNC_EVERY", "DILOCO_BF16_COMM", "DILOCO_NUM_FRAGMENTS"):
        monkeypatch.delenv(name, raising=False)
    idle = hf.DiLoCoCallback()
    assert not idle.active and idle.sync_every == 500 and idle.bf16_comm is True
    assert idle.state_dict() == {}
    monkeypatch.setenv("DILOCO_SERVER", "127.0.0.1:9")
    monkeypatch.setenv("DILOCO_SYNC_EVERY", "8")
    monkeypatch.setenv("DILOCO_BF16_COMM", "false")
    monkeypatch.setenv("DILOCO_NUM_FRAGMENTS", "4")
    configured = DiLoCoCallback()
    assert configured.active and configured.server_addr == "http://127.0.0.1:9"
    assert (configured.sync_every, configured.bf16_comm, configured.num_fragments) == (8, False, 4)
    assert DiLoCoCallback(sync_every=2, num_fragments=1).sync_every == 2  # arguments win
    monkeypatch.setenv("DILOCO_SYNC_EVERY", "often")
    with pytest.raises(ValueError, match="DILOCO_SYNC_EVERY='often': expected int"):
        DiLoCoCallback()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server_addr": "nowhere"}, "server_addr must be 'host:port'"),
        ({"sync_every": 0}, "sync_every must be an int >= 1"),
        ({"sync_every": 2, "num_fragments": 4}, r"num_fragments \(4\) must be <= sync_every"),
        ({"heartbeat_interval": -1}, "heartbeat_interval must be seconds > 0"),
        ({"bf16_comm": "yes"}, "bf16_comm must be True or False"),
        ({"max_sync_retries": -1}, "max_sync_retries must be an int >= 0"),
    ],
)
def test_bad_worker_settings_are_refused_with_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiLoCoCallback(**{"server_addr": "127.0.0.1:9", **kwargs})


def test_fragments_are_contiguous_nonempty_and_cover_the_model():
    sizes = [(f"p{i}", n) for i, n in enumerate([1000, 10, 10, 500, 500, 20, 3000, 5])]
    for count in range(1, len(sizes) + 1):
        groups = split_fragments(sizes, count)
        assert len(groups) == count and all(groups)
        assert [n for g in groups for n in g] == [n for n, _ in sizes]
    with pytest.raises(ValueError, match="more than the model's 8 parameter tensors"):
        split_fragments(sizes, 9)


@pytest.fixture
def server(tmp_path):
    thread = ServerThread(
        ServerSettings(port=0, token=TOKEN, checkpoint_dir=str(tmp_path / "server"))
    ).start()
    yield thread
    thread.stop()


def test_a_wrong_token_is_refused_and_an_unreachable_server_is_named(server):
    with pytest.raises(ServerRefused, match=r"401.*Bearer"):
        DiLoCoClient(server.address, token="not-the-token-at-all").status()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ServerUnavailable, match=f"127.0.0.1:{closed} unreachable"):
        DiLoCoClient(f"127.0.0.1:{closed}", timeout=2).status()


def test_a_worker_with_another_model_or_fragment_count_is_refused_with_the_reason(server):
    client = DiLoCoClient(server.address, token=TOKEN, timeout=20)
    first = dict(torch.nn.Linear(4, 2).named_parameters())
    client.join(first, {"worker_id": "a", "heartbeat_interval": 5.0, "num_fragments": 2})
    other = dict(torch.nn.Linear(4, 3).named_parameters())
    mismatch = r"409.*not the server's.*other shapes \['bias', 'weight'\]"
    with pytest.raises(ServerRefused, match=mismatch):
        client.join(other, {"worker_id": "b", "heartbeat_interval": 5.0, "num_fragments": 2})
    with pytest.raises(ServerRefused, match="num_fragments=1, but the server runs 2 fragments"):
        client.join(first, {"worker_id": "b", "heartbeat_interval": 5.0, "num_fragments": 1})
    assert server.server.status()["members"] == ["a"]


def test_bf16_communication_halves_the_bytes_a_worker_sends(server):
    model = torch.nn.Linear(256, 256)  # 65,792 parameters
    client = DiLoCoClient(server.address, token=TOKEN, timeout=20)
    names = dict(model.named_parameters())
    _, meta = client.join(names, {"worker_id": "solo", "heartbeat_interval": 5.0})
    grads = {n: torch.randn_like(p) for n, p in names.items()}
    sent = []
    for bf16 in (False, True):
        before, received = client.bytes_sent, server.server.bytes_received
        _, answer = client.sync(
            grads, {"worker_id": "solo", "fragment": 0, "round": meta["rounds"][0]}, bf16=bf16
        )
        meta["rounds"] = answer["rounds"]
        sent.append(client.bytes_sent - before)
        assert server.server.bytes_received - received == sent[-1]  # what arrived, too
    ratio = sent[1] / sent[0]
    assert 0.49 < ratio < 0.51, sent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(48, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _local_step(model, opt, rank: int, step: int) -> None:
    x, y = _data(rank)
    xb, yb = x[step * 4 : (step + 1) * 4], y[step * 4 : (step + 1) * 4]
    loss = ((model(xb) - yb) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _threads(target, count: int) -> None:
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            target(rank)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def test_with_every_worker_present_the_server_matches_the_all_reduce_variant(tmp_path):
    """Three workers, no DyLU, fp32: after each round the server's global weights are the
    all-reduce callback's, taken on three threads of one torch.distributed world."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    workers, rounds, sync_every = 3, 3, 4
    # Built here, one after another: torch.manual_seed is global, threads would race on it.
    models = {kind: [_model() for _ in range(workers)] for kind in ("reduce", "server")}
    reference: dict[int, list[torch.Tensor]] = {}
    store = dist.HashStore()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:

        def all_reduce_rank(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=workers, store=store)
            try:
                model = models["reduce"][rank]
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                diloco = DiLoCo(sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9)
                ctx = types.SimpleNamespace(
                    model=model,
                    state=types.SimpleNamespace(world_size=workers, step=0),
                    config=types.SimpleNamespace(train=types.SimpleNamespace(parallel="local")),
                )
                diloco.on_train_start(ctx)
                reference[rank] = []
                for step in range(rounds * sync_every):
                    _local_step(model, opt, rank, step)
                    ctx.state.step = step + 1
                    diloco.on_train_step_end(ctx)
                    if (step + 1) % sync_every == 0:
                        reference[rank].append(
                            torch.cat([p.detach().flatten() for p in model.parameters()])
                        )
            finally:
                dist.destroy_process_group()

        _threads(all_reduce_rank, workers)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()

    server = ServerThread(ServerSettings(port=0, min_workers=workers)).start()
    served: dict[int, list[torch.Tensor]] = {}
    try:

        def worker(rank: int) -> None:
            model = models["server"][rank]
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            w = DiLoCoWorker(
                model, server_addr=server.address, sync_every=sync_every,
                worker_id=f"w{rank}", bf16_comm=False, dylu=False, heartbeat_interval=1.0,
                num_fragments=1, timeout=30, max_sync_retries=0,
            )  # fmt: skip
            w.start()
            served[rank] = []
            for step in range(rounds * sync_every):
                _local_step(model, opt, rank, step)
                w.after_step()
                if (step + 1) % sync_every == 0:
                    served[rank].append(
                        torch.cat([p.detach().flatten() for p in model.parameters()])
                    )
            w.stop()

        _threads(worker, workers)
        assert server.server.status()["rounds"] == [rounds]
    finally:
        server.stop()
    for rank in range(workers):
        assert len(served[rank]) == len(reference[rank]) == rounds
        for mine, theirs in zip(served[rank], reference[rank], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
        assert not torch.equal(served[rank][0], served[rank][1])  # the weights did move


def _run_workers(address: str, pauses: list[float], steps: int, **settings) -> list:
    """Workers on threads, worker i pausing ``pauses[i]`` s per local step; returns them."""
    workers = []
    for i in range(len(pauses)):
        model = _model()
        workers.append(
            DiLoCoWorker(
                model,
                server_addr=address,
                worker_id=f"w{i}",
                bf16_comm=False,
                heartbeat_interval=1.0,
                timeout=30,
                max_sync_retries=0,
                **settings,
            )
        )
    for w in workers:
        w.start()
    waits: dict[int, list[float]] = {i: [] for i in range(len(pauses))}
    synced_at: dict[int, list[int]] = {i: [] for i in range(len(pauses))}
    periods: dict[int, list[int]] = {i: [] for i in range(len(pauses))}

    def run(i: int) -> None:
        w = workers[i]
        opt = torch.optim.SGD(w.model.parameters(), lr=0.05)
        for step in range(steps):
            _local_step(w.model, opt, i, step % 12)
            time.sleep(pauses[i])
            before = w.fragment_syncs
            w.after_step()
            if w.fragment_syncs > before:
                synced_at[i].append(w.local_step)
                waits[i].append(w.last_sync_time)
                periods[i].append(w.sync_every)
        w.stop()

    _threads(run, len(pauses))
    for i, w in enumerate(workers):
        w.waits, w.synced_at, w.periods = waits[i], synced_at[i], periods[i]
    return workers


def test_dylu_gives_a_slower_worker_fewer_local_steps_so_the_fast_one_waits_less():
    server = ServerThread(ServerSettings(port=0)).start()
    try:
        plain = _run_workers(
            server.address, [0.002, 0.02], 48, sync_every=8, dylu=False, num_fragments=1
        )
    finally:
        server.stop()
    server = ServerThread(ServerSettings(port=0)).start()
    try:
        dylu = _run_workers(
            server.address, [0.002, 0.02], 48, sync_every=8, dylu=True, num_fragments=1
        )
    finally:
        server.stop()
    fast, slow = dylu
    # While both run, the ~10x slower worker syncs after 1 or 2 steps instead of 8 (once
    # the fast one has left, it is the fastest and goes back to 8).
    assert set(fast.periods) == {8} and min(slow.periods) <= 2
    assert slow.dylu_adjustments >= 1 and fast.dylu_adjustments == 0
    assert all(set(w.periods) == {8} for w in plain)
    # The fast worker's time blocked in a round (after the first, which sets the speeds).
    waited_plain = sum(plain[0].waits[1:]) / len(plain[0].waits[1:])
    waited_dylu = sum(fast.waits[1:]) / len(fast.waits[1:])
    assert waited_dylu < 0.5 * waited_plain, (waited_dylu, waited_plain)


def test_fragments_sync_staggered_through_the_period_each_with_its_own_round():
    server = ServerThread(ServerSettings(port=0)).start()
    try:
        workers = _run_workers(
            server.address, [0, 0], 12, sync_every=4, num_fragments=2, dylu=False
        )
        state = server.server.status()
        final = server.server.global_weights()
    finally:
        server.stop()
    assert state["rounds"] == [3, 3]
    for w in workers:
        # Fragment 0 is sent at H/2 and fragment 1 at H; each answer is taken in when the
        # next fragment is due (training went on meanwhile), the last one when training ends.
        assert w.synced_at == [4, 6, 8, 10, 12]
        assert (w.fragment_syncs, w.sync_count) == (6, 3)
        # contiguous groups of similar size, in model order: 128 values, then 16 + 16 + 1
        assert w.fragments == [["0.weight"], ["0.bias", "2.weight", "2.bias"]]
        # fragment 1 came back after the last step; fragment 0 took in its weights with the
        # two steps trained since step 10 added
        params = dict(w.model.named_parameters())
        assert all(torch.equal(params[n].detach(), final[n]) for n in w.fragments[1])
        assert not torch.equal(params["0.weight"].detach(), final["0.weight"])


def test_a_streamed_fragment_keeps_what_the_worker_learned_while_it_was_away():
    server = ServerThread(ServerSettings(port=0)).start()
    try:
        model = _model()
        w = DiLoCoWorker(
            model, server_addr=server.address, sync_every=4, worker_id="solo", bf16_comm=False,
            dylu=False, heartbeat_interval=5.0, num_fragments=2, timeout=30, max_sync_retries=0,
        )  # fmt: skip
        w.start()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        weight = dict(model.named_parameters())["0.weight"]  # fragment 0
        seen = {}
        for step in range(1, 5):
            _local_step(model, opt, 0, step)
            seen[step] = weight.detach().clone()  # before after_step: what training made
            w.after_step()
        # Fragment 0 was sent after step 2 and taken in at step 4: the server's new weights
        # plus the two steps trained meanwhile, not the server's weights alone.
        fresh = server.server.global_weights(0)["0.weight"]
        assert not torch.equal(fresh, seen[4])
        torch.testing.assert_close(weight.detach(), fresh + (seen[4] - seen[2]))
        w.stop()
    finally:
        server.stop()


def test_a_round_closes_at_its_deadline_and_a_late_pseudo_gradient_is_answered_stale():
    server = ServerThread(ServerSettings(port=0, round_timeout=0.5)).start()
    try:
        model = torch.nn.Linear(4, 2)
        names = dict(model.named_parameters())
        grads = {n: torch.ones_like(p) for n, p in names.items()}
        clients = {w: DiLoCoClient(server.address, timeout=20) for w in ("fast", "late")}
        for w, client in clients.items():  # both live: the round expects both
            client.join(names, {"worker_id": w, "heartbeat_interval": 60.0})
        started = time.monotonic()
        fresh, meta = clients["fast"].sync(
            grads, {"worker_id": "fast", "fragment": 0, "round": 0}, bf16=False
        )
        waited = time.monotonic() - started
        assert 0.4 < waited < 10 and meta["round"] == 1 and meta["contributors"] == 1
        stale, meta = clients["late"].sync(
            grads, {"worker_id": "late", "fragment": 0, "round": 0}, bf16=False
        )
        assert meta["stale"] is True and meta["round"] == 1  # not applied: the weights of now
        for n in names:
            assert torch.equal(stale[n], fresh[n])
        assert server.server.status()["rounds"] == [1]
    finally:
        server.stop()


def test_a_restarted_server_continues_from_its_checkpoint(tmp_path):
    settings = ServerSettings(port=0, token=TOKEN, checkpoint_dir=str(tmp_path))
    first = ServerThread(settings).start()
    model = torch.nn.Linear(4, 2)
    client = DiLoCoClient(first.address, token=TOKEN, timeout=20)
    names = dict(model.named_parameters())
    _, meta = client.join(names, {"worker_id": "a", "heartbeat_interval": 5.0})
    grads = {n: torch.ones_like(p) for n, p in names.items()}
    after, _ = client.sync(grads, {"worker_id": "a", "fragment": 0, "round": 0}, bf16=False)
    first.stop()
    again = ServerThread(settings).start()
    try:
        state = DiLoCoClient(again.address, token=TOKEN).status()
        assert state["rounds"] == [1] and state["members"] == ["a"]
        client = DiLoCoClient(again.address, token=TOKEN, timeout=20)
        weights, meta = client.join(names, {"worker_id": "a", "heartbeat_interval": 5.0})
        assert meta["rounds"] == [1]
        for n in names:
            assert torch.equal(weights[n], after[n])
        # the momentum came back too. Nesterov (lr 0.7, momentum 0.9) on a constant
        # pseudo-gradient of 1 moves 0.7 * 1.9, then 0.7 * (1 + 0.9 * 1.9); without the
        # saved momentum the second step would repeat the first.
        second, _ = client.sync(grads, {"worker_id": "a", "fragment": 0, "round": 1}, bf16=False)
        first_move = names["weight"].detach() - after["weight"]
        second_move = after["weight"] - second["weight"]
        torch.testing.assert_close(first_move, torch.full_like(first_move, 0.7 * 1.9))
        torch.testing.assert_close(second_move, torch.full_like(second_move, 0.7 * 2.71))
    finally:
        again.stop()


def _fit(callback, out_dir, steps: int, resume=None):
    from hookloop import CallbackManager, Config, DataConfig, TrainConfig, Trainer
    from hookloop.testing import TinyModel, ToyData

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


def test_the_callback_logs_its_syncs_and_resumes_its_counters_and_id(server, tmp_path):
    def worker():
        return hf.DiLoCoCallback(
            server.address, 2, None, False, heartbeat_interval=1.0, token=TOKEN
        )

    _, logs = _fit(worker(), tmp_path / "run", steps=4)
    assert [log["diloco/sync_count"] for log in logs] == [1, 2]
    assert logs[-1]["diloco/bytes_sent"] > 0 and logs[-1]["diloco/stale_syncs"] == 0
    saved = torch.load(
        tmp_path / "run" / "checkpoints" / "step-00000004" / "trainer_state.pt",
        weights_only=True,
    )["callbacks"]["DiLoCoCallback"]
    assert saved["sync_count"] == 2 and saved["local_step"] == 4 and saved["sync_every"] == 2
    resumed = worker()
    trainer, logs = _fit(resumed, tmp_path / "run", steps=8, resume="auto")
    assert [log["diloco/sync_count"] for log in logs] == [3, 4]  # counted on from the checkpoint
    assert resumed.state_dict()["worker_id"] == saved["worker_id"]  # rejoined under its id
    assert server.server.status()["rounds"] == [4] and server.server.status()["members"] == []
    # the worker ends holding the server's global weights
    final = server.server.global_weights()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), final[name])


def test_serve_refuses_bad_settings_with_what_is_allowed(capsys):
    code = cli_main(["diloco", "serve", "--port", "0", "--outer-momentum", "1.5"])
    assert code == 2
    assert "outer_momentum must lie in [0, 1), got 1.5" in capsys.readouterr().err
    assert cli_main(["diloco", "serve", "--port", "0", "--certfile", "c.pem"]) == 2
    assert "needs both certfile and keyfile" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_a_certificate_and_key(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server = ServerThread(
        ServerSettings(port=0, token=TOKEN, certfile=str(cert), keyfile=str(key))
    ).start()
    try:
        assert server.address.startswith("https://127.0.0.1:")
        assert DiLoCoClient(server.address, token=TOKEN, cafile=str(cert)).status()["rounds"] == []
        with pytest.raises(ServerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            DiLoCoClient(server.address, token=TOKEN, timeout=5).status()  # not trusted
    finally:
        server.stop()


# -- separate processes ------------------------------------------------------------------
def _serve(port: int, state_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hookloop", "diloco", "serve", "--port", str(port),
           "--checkpoint-dir", str(state_dir), "--token", TOKEN, "--min-workers", "2",
           "--round-timeout", "30", "--outer-momentum", "0.5"]  # fmt: skip
    # A real process: its start-up is the downtime after which the workers must reconnect.
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))


def _worker(out: Path, index: int, workers: int, port: int, *overrides: str, sleep: float = 0):
    env = {**os.environ, "DILOCO_TOKEN": TOKEN, "DILOCO_SLEEP": str(sleep)}
    cmd = [sys.executable, JOB, "worker", str(out), str(index), str(workers),
           f"127.0.0.1:{port}", *overrides]  # fmt: skip
    log = (out / f"worker-{index}.log").open("ab")
    return zygote.Popen(cmd, stdout=log, stderr=log, env=env, cwd=str(out))


def _status(port: int) -> dict | None:
    try:
        return DiLoCoClient(f"127.0.0.1:{port}", token=TOKEN, timeout=2).status()
    except (ServerUnavailable, ServerRefused):
        return None


def _round(port: int) -> int:
    """The server's current round (0 before the first worker joins, or while it is down)."""
    return ((_status(port) or {}).get("rounds") or [0])[0]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _finish(procs, out: Path, timeout: float = 120) -> list[dict]:
    results = []
    for index, proc in procs:
        code = proc.wait(timeout=timeout)
        log = (out / f"worker-{index}.log").read_text()[-3000:]
        assert code == 0, log
        results.append(json.loads((out / f"result-worker-{index}.json").read_text()))
    return results


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _mean_loss(result: dict, first: bool) -> float:
    """The mean of the first (or last) four logged losses."""
    ordered = [v for _, v in sorted(result["losses"].items(), key=lambda kv: int(kv[0]))]
    values = ordered[:4] if first else ordered[-4:]
    return sum(values) / len(values)


def _server_thread(min_workers: int = 1) -> ServerThread:
    """The server in this process (the killed-server test runs `hookloop diloco serve`)."""
    settings = ServerSettings(port=0, token=TOKEN, outer_momentum=0.5, min_workers=min_workers)
    return ServerThread(settings).start()


@pytest.mark.slow
def test_three_worker_processes_and_a_server_lower_the_loss(tmp_path):
    server = _server_thread(min_workers=3)  # no round before all three have joined
    port = server.port
    try:
        procs = [(i, _worker(tmp_path, i, 3, port, "train.max_steps=24")) for i in range(3)]
        results = _finish(procs, tmp_path)
        state = _status(port)
    finally:
        server.stop()
    assert state is not None and state["rounds"] == [6]  # 24 steps / sync_every 4
    for r in results:
        assert r["step"] == 24 and r["metrics"]["diloco/sync_count"] == 6
        assert _mean_loss(r, first=False) < 0.5 * _mean_loss(r, first=True)
    # after the last round every worker holds the same global weights
    assert results[0]["synced"][-1] == results[1]["synced"][-1] == results[2]["synced"][-1]


@pytest.mark.slow
def test_a_killed_worker_is_dropped_and_rejoins_and_the_run_finishes(tmp_path):
    server = _server_thread()
    port = server.port
    steps = "train.max_steps=40"
    try:
        procs = {i: _worker(tmp_path, i, 2, port, steps, sleep=0.05) for i in range(2)}
        _wait_for(lambda: _round(port) >= 2, 60, "two rounds")
        procs[1].kill()  # SIGKILL: no leave, no goodbye
        procs[1].wait()
        _wait_for(lambda: "w1" not in (_status(port) or {}).get("members", ["w1"]), 10, "a drop")
        closed = _round(port)
        _wait_for(lambda: _round(port) > closed, 10, "a round without w1")
        procs[1] = _worker(tmp_path, 1, 2, port, steps, sleep=0.05)  # same id, fresh process
        results = _finish(sorted(procs.items()), tmp_path)
        state = _status(port)
    finally:
        server.stop()
    assert [r["step"] for r in results] == [40, 40]
    assert state["members"] == []  # both left when they finished
    assert state["rounds"][0] >= 10  # 40 / 4 rounds for worker 0, plus the rejoined worker's


@pytest.mark.slow
def test_a_killed_server_restarted_on_its_checkpoint_lets_the_workers_continue(tmp_path):
    port = _free_port()
    state_dir = tmp_path / "server"
    server = _serve(port, state_dir, tmp_path / "server.log")
    steps = "train.max_steps=40"
    try:
        _wait_for(lambda: _status(port) is not None, 60, "the server to listen")
        procs = [(i, _worker(tmp_path, i, 2, port, steps, sleep=0.05)) for i in range(2)]
        _wait_for(lambda: _round(port) >= 3, 60, "three rounds")
        before = _round(port)
        server.kill()
        server.wait()
        server = _serve(port, state_dir, tmp_path / "server.log")
        _wait_for(lambda: _status(port) is not None, 60, "the restarted server")
        assert _round(port) >= before  # it continued from its checkpoint
        results = _finish(procs, tmp_path)
        state = _status(port)
    finally:
        _stop(server)
    assert [r["step"] for r in results] == [40, 40]
    # 40 steps / sync_every 4; one sync may find its round closed just before the kill
    assert state["rounds"][0] in (9, 10)
    assert sum(r["metrics"]["diloco/reconnections"] for r in results) >= 1
    assert "continuing from" in (tmp_path / "server.log").read_text()
    assert results[0]["synced"][-1] == results[1]["synced"][-1]


@pytest.mark.slow
def test_a_worker_that_is_a_torchrun_job_talks_from_rank_0_and_broadcasts(server, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           JOB, "ddp", str(tmp_path), "0", "1", server.address, "data.batch_size=4"]  # fmt: skip
    env = {**os.environ, "DILOCO_TOKEN": TOKEN}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"result-ddp-{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in ranks] == [12, 12]
    assert ranks[0]["synced"] == ranks[1]["synced"] and len(ranks[0]["synced"]) == 3
    assert server.server.status()["rounds"] == [3]  # one worker: its rank 0
    assert ranks[0]["metrics"]["diloco/bytes_sent"] > 0
    assert ranks[1]["metrics"]["diloco/bytes_sent"] == 0  # rank 1 never talked to the server
    assert ranks[1]["metrics"]["diloco/sync_count"] == 3  # but took every sync's weights
    final = torch.cat([t.flatten() for t in server.server.global_weights().values()])
    torch.testing.assert_close(torch.tensor(ranks[1]["synced"][-1]), final, rtol=0, atol=0)
