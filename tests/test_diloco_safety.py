"""What a DiLoCo server and its workers must not lose.

- the rounds done since the last periodic save, when the server is stopped by a signal;
- the newest checkpoint, when a file's modification time lies (checkpoints are ordered
  by the round in their names, and each must record the round its name says);
- the output directory, when a second server is pointed at it (one holds a lock);
- the rounds of a server started from Forgather's sharded checkpoint format, when it is
  restarted on its own output directory (parameters are matched by name);
- a worker's run, when its server is gone for good (it stops, naming why, instead of
  training alone and exiting 0) or answers with no tensors.

A mixed fleet (a hookloop client and a Forgather-style peer with no token and no worker
secret) drives the rounds by hand, so every check counts rounds, not seconds. 127.0.0.1
only; every wait is bounded; every child is killed in ``finally``.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import _zygote as zygote
from hookloop.app.failures import error_line
from hookloop.diloco import storage
from hookloop.diloco.callback import DiLoCoCallback
from hookloop.diloco.client import DiLoCoClient, ServerUnavailable
from hookloop.diloco.server import DiLoCoServer
from hookloop.diloco.wire import load_tensors
from hookloop.diloco.worker import DiLoCoWorker
from hookloop.recipes import default_config, get_recipe
from hookloop.testing import TinyModel
from test_diloco_membership import ForgatherPeer
from test_diloco_server import _free_port

OPEN = {"disable_auth": True, "allow_unbound_workers": True}


# -- a mixed fleet, round by round -----------------------------------------------------------
def _recipe_model() -> torch.nn.Module:
    cfg = default_config("mlp-regression")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return get_recipe("mlp-regression").build(cfg).model


def forgather_checkpoint(directory: Path, model: torch.nn.Module) -> Path:
    """``model``'s parameters as Forgather saves a model: two safetensors shards and an index
    whose ``weight_map`` lists the parameters in the model's order (not sorted)."""
    directory.mkdir(parents=True)
    params = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    names = list(params)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}  # fmt: skip
    for shard, held in shards.items():
        save_file({n: params[n] for n in held}, directory / shard)
    weight_map = {n: shard for shard, held in shards.items() for n in held}
    total = sum(t.numel() * t.element_size() for t in params.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / storage.SAFE_INDEX).write_text(json.dumps(index, indent=2))
    return directory


def _grads(names: list[str], shapes: dict[str, torch.Size], r: int, k: int):
    return {n: torch.full(shapes[n], 0.01 * k * (r + 1)) for n in names}


class Fleet:
    """A hookloop client and a Forgather peer submitting together, one round at a time."""

    def __init__(self, address: str) -> None:
        self.hookloop = DiLoCoClient(address, timeout=60)
        self.forgather = ForgatherPeer(address)

    def join(self) -> dict[str, torch.Tensor]:
        weights = self.hookloop.register("hk")
        status, _, _ = self.forgather.register("fg")
        assert status == 200
        self.shapes = {n: w.shape for n, w in weights.items()}
        return weights

    def round(self, r: int) -> dict[str, torch.Tensor]:
        """Round ``r`` (0-based): both submit; returns the new global weights."""
        names = list(self.shapes)
        answers: dict[str, object] = {}

        def hookloop() -> None:
            answers["hk"] = self.hookloop.submit_pseudogradients(
                "hk", _grads(names, self.shapes, r, 1)
            )

        def forgather() -> None:
            answers["fg"] = self.forgather.submit("fg", _grads(names, self.shapes, r, 2))

        threads = [threading.Thread(target=f, daemon=True) for f in (hookloop, forgather)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert set(answers) == {"hk", "fg"}, f"round {r} did not close"
        status, body, _ = answers["fg"]
        assert status == 200, body[:300]
        theirs = load_tensors(body)
        ours = answers["hk"]
        assert all(torch.equal(theirs[n], ours[n]) for n in names)
        return ours


def _reference(start: Path, tmp_path: Path, rounds: int) -> list[dict[str, torch.Tensor]]:
    """The global weights after each of ``rounds`` rounds of an uninterrupted server."""
    srv = DiLoCoServer(str(tmp_path / "reference"), 2, str(start), port=0,
                       save_every_n_rounds=0, **OPEN).start()  # fmt: skip
    try:
        fleet = Fleet(srv.address)
        fleet.join()
        return [fleet.round(r) for r in range(rounds)]
    finally:
        srv.stop()


def _serve(out: Path, port: int, start: Path, log: Path, *extra: str):
    cmd = [sys.executable, "-m", "hookloop", "diloco", "serve", "-o", str(out), "-n", "2",
           "--port", str(port), "--no-auth", "--allow-unbound-workers", "-c", str(start),
           "--heartbeat-timeout", "0", *extra]  # fmt: skip
    return zygote.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))


def _listening(port: int, proc, log: Path) -> int:
    """The round the server at ``port`` reports once it listens (600 polls at most)."""
    client = DiLoCoClient(f"127.0.0.1:{port}", timeout=5)
    for _ in range(600):
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            return client.get_status()["sync_round"]
        except ServerUnavailable:
            time.sleep(0.1)
    raise AssertionError(f"the server did not listen within 600 polls: {log.read_text()[-2000:]}")


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("signum", "save_every", "code"),
    [(signal.SIGTERM, 5, 143), (signal.SIGINT, 5, 130), (signal.SIGKILL, 1, -signal.SIGKILL)],
    ids=["SIGTERM saves", "SIGINT saves", "SIGKILL after a save every round"],
)
def test_a_mixed_fleet_from_forgathers_sharded_checkpoint_resumes_at_its_round(
    tmp_path, signum, save_every, code
):
    """A server started from Forgather's sharded format, stopped after two rounds by a
    signal (SIGTERM/SIGINT with saves every 5 rounds; SIGKILL with a save every round),
    restarted with the same command line on its own output directory: it continues at
    round 2, and its third round is bitwise the third round of a server never stopped."""
    start = forgather_checkpoint(tmp_path / "forgather", _recipe_model())
    reference = _reference(start, tmp_path, 3)
    out, log, port = tmp_path / "out", tmp_path / "server.log", _free_port()
    extra = ("--save-every", str(save_every))
    server = _serve(out, port, start, log, *extra)
    again = None
    try:
        assert _listening(port, server, log) == 0
        fleet = Fleet(f"127.0.0.1:{port}")
        fleet.join()
        for r in range(2):
            assert all(torch.equal(v, reference[r][n]) for n, v in fleet.round(r).items())
        server.send_signal(signum)
        exited = server.wait(timeout=120)
        again = _serve(out, port, start, log, *extra)
        resumed_at = _listening(port, again, log)
        assert (resumed_at, exited) == (2, code), log.read_text()[-3000:]
        weights = fleet.join()
        assert all(torch.equal(v, reference[1][n]) for n, v in weights.items())
        third = fleet.round(2)  # with the saved momentum: bitwise the uninterrupted third
        assert all(torch.equal(v, reference[2][n]) for n, v in third.items())
    finally:
        _stop(server)
        if again is not None:
            _stop(again)
    assert "continuing from" in log.read_text()


# -- the newest checkpoint is the highest round ---------------------------------------------
def _single(tmp_path: Path, *, again: bool = False, **kwargs) -> DiLoCoServer:
    """A one-worker server on ``tmp_path/out``: started from a TinyModel, or ``again`` from
    the newest checkpoint there."""
    start = tmp_path / "start"
    if not storage.is_checkpoint(start):
        storage.save_initial(start, TinyModel(seed=1))
    settings = {"port": 0, "save_every_n_rounds": 1, **OPEN, **kwargs}
    return DiLoCoServer(str(tmp_path / "out"), 1, None if again else str(start), **settings)


def _rounds(srv: DiLoCoServer, count: int) -> dict[str, torch.Tensor]:
    client = DiLoCoClient(srv.address, timeout=30)
    weights = client.register("w")
    for _ in range(count):
        weights = client.submit_pseudogradients(
            "w", {n: torch.full_like(v, 0.01) for n, v in weights.items()}
        )
    client.deregister("w")
    return weights


def _round_of(checkpoint: Path) -> int:
    state = storage.load_server_state(checkpoint)
    assert state is not None
    return int(state["sync_round"])


def test_a_touched_old_checkpoint_neither_rewinds_a_restart_nor_costs_the_newest(tmp_path):
    srv = _single(tmp_path, save_total_limit=3).start()
    try:
        after_three = _rounds(srv, 3)
    finally:
        srv.stop()
    saved = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == [f"checkpoint-{r}" for r in (1, 2, 3)]
    future = time.time() + 3600
    os.utime(saved / "checkpoint-1", (future, future))  # `touch`, or a copy tool's mtime
    again = _single(tmp_path, again=True, save_total_limit=3)
    assert again.status()["sync_round"] == 3
    assert all(torch.equal(v, after_three[n]) for n, v in again.get_global_params().items())
    again.start()
    try:
        _rounds(again, 1)
    finally:
        again.stop()
    kept = sorted(p.name for p in saved.iterdir())
    assert kept == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]  # rotated by round
    assert [_round_of(saved / name) for name in kept] == [2, 3, 4]


def test_a_checkpoint_whose_recorded_round_is_not_its_name_is_refused_by_name(tmp_path):
    srv = _single(tmp_path).start()
    try:
        _rounds(srv, 2)
    finally:
        srv.stop()
    saved = tmp_path / "out" / "checkpoints"
    shutil.copytree(saved / "checkpoint-1", saved / "checkpoint-7")  # a copy under a new name
    with pytest.raises(ValueError) as refused:
        _single(tmp_path, again=True)
    message = str(refused.value)
    assert "\n" not in message
    assert "checkpoint-7" in message and "round 1" in message, message


def test_a_fresh_start_into_an_output_dir_holding_a_run_is_refused(tmp_path):
    """from_checkpoint= on an output dir that holds checkpoints would start again at round
    0 and rotation would remove its saves under the old run's higher rounds."""
    srv = _single(tmp_path, save_total_limit=2).start()
    try:
        _rounds(srv, 3)
    finally:
        srv.stop()
    with pytest.raises(ValueError, match=r"holds a run's checkpoints up to checkpoint-3"):
        _single(tmp_path)
    rewind = tmp_path / "out" / "checkpoints" / "checkpoint-2"
    assert DiLoCoServer(str(tmp_path / "out"), 1, str(rewind), port=0,
                        **OPEN).status()["sync_round"] == 2  # fmt: skip


# -- one server per output directory ----------------------------------------------------------
def test_a_second_server_on_the_same_output_dir_exits_naming_the_holder(tmp_path):
    first = _single(tmp_path).start()
    log = tmp_path / "second.log"
    second = None
    try:
        second = _serve(tmp_path / "out", _free_port(), tmp_path / "start", log)
        serving = "hookloop diloco: serving http"
        for _ in range(600):  # it exits, or it says it serves (the old behaviour)
            if second.poll() is not None or serving in log.read_text():
                break
            time.sleep(0.1)
        served = serving in log.read_text()
        assert not served and second.wait(timeout=60) == 2, log.read_text()[-2000:]
        text = log.read_text()
        assert "Traceback" not in text
        (line,) = [line for line in text.splitlines() if "in use by" in line]
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in line
        assert "--output-dir" in line
        # in one process too: a second server on the directory is refused at start
        twin = _single(tmp_path)
        with pytest.raises(RuntimeError, match=r"in use by another DiLoCo server"):
            twin.start()
    finally:
        first.stop()
        if second is not None:
            _stop(second)


# -- parameters matched by name ---------------------------------------------------------------
def test_a_checkpoint_that_does_not_fit_its_server_state_names_the_parameters(tmp_path):
    start = forgather_checkpoint(tmp_path / "start", _recipe_model())
    srv = DiLoCoServer(str(tmp_path / "out"), 1, str(start), port=0, save_every_n_rounds=1,
                       **OPEN).start()  # fmt: skip
    try:
        _rounds(srv, 1)
    finally:
        srv.stop()
    resumed = DiLoCoServer(str(tmp_path / "out"), 1, port=0, **OPEN)  # from its own checkpoint
    assert resumed.status()["sync_round"] == 1
    saved = tmp_path / "out" / "checkpoints" / "checkpoint-1" / storage.SAFE_WEIGHTS
    weights = storage.load_weights(saved.parent)
    weights["extra.weight"] = weights.pop("0.weight")
    weights["3.bias"] = torch.zeros(2)
    save_file(weights, saved)
    with pytest.raises(ValueError) as refused:
        DiLoCoServer(str(tmp_path / "out"), 1, port=0, **OPEN)
    message = str(refused.value)
    assert "\n" not in message
    for part in ("missing 0.weight", "unexpected extra.weight", "3.bias has shape (2,)"):
        assert part in message, message


# -- workers ----------------------------------------------------------------------------------
def _fit_against(address: str, steps: int, stop_server_at: int, srv: DiLoCoServer):
    from hookloop import CallbackManager, Config, DataConfig, TrainConfig, Trainer
    from hookloop.testing import ToyData

    worker = DiLoCoCallback(address, 2, None, False, heartbeat_interval=0, max_sync_retries=0)
    manager = CallbackManager(worker)
    manager.register(
        "on_train_step_end",
        lambda ctx: srv.stop() if ctx.state.step == stop_server_at else None,
        priority=90,  # after the worker's sync of that step
    )
    cfg = Config(train=TrainConfig(max_steps=steps, log_every=2), data=DataConfig(batch_size=4))
    trainer = Trainer(TinyModel(), train_data=ToyData(n=64), loss_fn=TinyModel.loss_fn,
                      config=cfg, callbacks=manager)  # fmt: skip
    return trainer.train()


def test_a_worker_whose_server_is_gone_stops_after_the_bound_naming_why(tmp_path, monkeypatch):
    """Server gone after the first sync; syncs every 2 steps, no retries, at most 2 missed
    syncs in a row: the run stops at step 6, in one line naming the server (exit 1 from
    ``hookloop train``), instead of training 20 steps alone and ending as if it had synced."""
    monkeypatch.setenv("DILOCO_MAX_MISSED_SYNCS", "2")
    srv = _single(tmp_path, save_every_n_rounds=0).start()
    address = srv.address
    with pytest.raises(ConnectionError) as lost:
        _fit_against(address, 20, 2, srv)
    line, code = error_line(lost.value)
    assert code == 1 and line is not None and "\n" not in line
    assert address in line and "2 syncs in a row" in line, line
    assert "DILOCO_MAX_MISSED_SYNCS" in line
    monkeypatch.setenv("DILOCO_MAX_MISSED_SYNCS", "-1")
    with pytest.raises(ValueError, match=r"DILOCO_MAX_MISSED_SYNCS must be an int >= 0, got -1"):
        DiLoCoCallback(address)


class _EmptyAnswers(http.server.BaseHTTPRequestHandler):
    """A server that answers every request with a state dict holding no tensors."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        buf = io.BytesIO()
        torch.save({}, buf)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(buf.getvalue())))
        self.end_headers()
        self.wfile.write(buf.getvalue())

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_that_sends_no_tensors_or_another_model_is_named_in_one_line(tmp_path):
    empty = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EmptyAnswers)
    thread = threading.Thread(target=empty.serve_forever, daemon=True)
    thread.start()
    try:
        worker = DiLoCoWorker(TinyModel(), f"127.0.0.1:{empty.server_address[1]}",
                              sync_every=1, heartbeat_interval=0)  # fmt: skip
        with pytest.raises(ValueError) as refused:
            worker.start()
            worker.after_step()
        assert "sent no tensors" in str(refused.value) and "\n" not in str(refused.value)
    finally:
        empty.shutdown()
        empty.server_close()
    other = DiLoCoServer(str(tmp_path / "out"), 1, str(forgather_checkpoint(
        tmp_path / "other", _recipe_model())), port=0, **OPEN).start()  # fmt: skip
    try:
        worker = DiLoCoWorker(TinyModel(), other.address, sync_every=1, heartbeat_interval=0)
        with pytest.raises(ValueError) as refused:
            worker.start()
            worker.after_step()
        message = str(refused.value)
        assert "lacks" in message and "another model" in message and "\n" not in message
    finally:
        other.stop()
