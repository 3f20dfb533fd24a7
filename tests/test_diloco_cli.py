"""``hookloop train`` as a DiLoCo worker: it joins the server that ``DILOCO_SERVER`` names
(``callbacks.diloco``, null: on when that is set), with its settings from ``DILOCO_*``."""

from __future__ import annotations

import pytest

from _quiet import SERVICES_OFF
from hookloop.app.cli import main
from hookloop.callbacks import read_jsonl
from hookloop.diloco import storage
from hookloop.diloco.server import DiLoCoServer
from hookloop.recipes import default_config, get_recipe

TOKEN = "diloco-cli-test-token-0123456789"
RUN = ["--recipe", "mlp-regression", "train.max_steps=4", "train.log_every=2",
       "logging.progress=false", *SERVICES_OFF]  # fmt: skip


@pytest.fixture
def server(tmp_path):
    start = storage.save_initial(tmp_path / "start", get_recipe("mlp-regression").build(
        default_config("mlp-regression")).model)  # fmt: skip
    srv = DiLoCoServer(str(tmp_path / "out"), 1, str(start), port=0, token=TOKEN).start()
    yield srv
    srv.stop()


@pytest.fixture
def diloco_env(monkeypatch, server):
    monkeypatch.setenv("DILOCO_SERVER", server.address)
    monkeypatch.setenv("DILOCO_HEARTBEAT_INTERVAL", "0")
    monkeypatch.setenv("DILOCO_TOKEN", TOKEN)
    monkeypatch.setenv("DILOCO_SYNC_EVERY", "2")
    monkeypatch.setenv("DILOCO_BF16_COMM", "false")
    return server


def _syncs(run) -> list[int]:
    records = read_jsonl(run / "metrics.jsonl")
    return [r["diloco/sync_count"] for r in records if r["kind"] == "train"]


def test_hookloop_train_joins_the_server_that_diloco_server_names(diloco_env, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *RUN]) == 0
    assert _syncs(run) == [1, 2]  # a round every 2 steps, logged with the run's metrics
    assert diloco_env.status()["sync_round"] == 2


def test_callbacks_diloco_false_keeps_a_run_out_of_the_server(diloco_env, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *RUN, "callbacks.diloco=false"]) == 0
    trained = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(trained) == 2 and not any("diloco/sync_count" in r for r in trained)
    assert diloco_env.status()["num_registered"] == 0  # no worker ever joined
    assert diloco_env.status()["sync_round"] == 0


def test_callbacks_diloco_true_without_a_server_says_what_to_set(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("DILOCO_SERVER", raising=False)
    code = main(["train", "--out", str(tmp_path / "run"), *RUN, "callbacks.diloco=true"])
    assert code == 2
    assert "callbacks.diloco=true needs DILOCO_SERVER=host:port" in capsys.readouterr().err
