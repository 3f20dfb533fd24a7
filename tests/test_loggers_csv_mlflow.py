"""metrics.csv (logging.csv) and MLflow (logging.mlflow) read back as their users read them:
with the csv module and with MLflow's own client. Each step once after a crash and a resume,
a key that appears late widens the table without losing a row, hostile keys and values
survive, a live `set` is recorded at its step. Everything is written under tmp_path."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from hookloop import Callback, Config, DataConfig, TrainConfig, Trainer
from hookloop.app.cli import main
from hookloop.callbacks.csv_logger import CSVLogger, read_csv_rows
from hookloop.testing import TinyModel, ToyData

mlflow_tracking = pytest.importorskip("mlflow.tracking")

HOSTILE = 'a,b "quoted"\nnext line'
LONG = "k" * 400
QUIET = ["logging.progress=false", "logging.tensorboard=false", "control.enabled=false"]


@pytest.fixture(autouse=True)
def _mlflow_in_tmp(tmp_path, monkeypatch):
    """MLflow writes nowhere but tmp_path (never ~/.mlflow or ./mlruns)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "env-mlruns").as_uri())
    monkeypatch.chdir(tmp_path)


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


class LateAndHostileKeys(Callback):
    """From step 3 on, a value under a key with commas, quotes and a newline, a 400-character
    key, and a text value with the same characters (producers add values in on_before_log)."""

    def on_before_log(self, ctx) -> None:
        if ctx.state.step >= 3:
            ctx.logs[HOSTILE] = float(ctx.state.step)
            ctx.logs[LONG] = 0.5
            ctx.logs["note"] = 'x, "y"\nz'


class Steer(Callback):
    """Files a live `set` at step 4, as the control server would."""

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == 4:
            ctx.control.request("set", **{"00000000000000000004": {"values": {"lr": 0.02},
                                                                   "client": "test"}})  # fmt: skip


def trainer(out: Path, *callbacks: Callback, resume: str | None = None) -> Trainer:
    """12 steps, a log each, an evaluation every 4, a checkpoint every 5."""
    cfg = Config(
        train=TrainConfig(
            max_steps=12, log_every=1, eval_every=4, eval_at_epoch_end=False, device="cpu",
            handle_signals=False,
        ),
        data=DataConfig(batch_size=4),
    )  # fmt: skip
    cfg.checkpoint.every = 5
    cfg.optimizer.lr = 0.01
    return Trainer(
        TinyModel(), train_data=ToyData(n=256), eval_data=ToyData(n=16, seed=1),
        loss_fn=TinyModel.loss_fn, config=cfg, callbacks=list(callbacks), out_dir=str(out),
        resume=resume,
    )  # fmt: skip


def train_cli(out: Path, *overrides: str) -> None:
    args = ["train", "--recipe", "mlp-regression", "--out", str(out), *QUIET]
    args += ["train.max_steps=6", "train.log_every=1", "train.eval_every=3", *overrides]
    assert main(args) == 0


# -- CSV ------------------------------------------------------------------------------


def test_logging_csv_writes_a_row_per_log_and_eval_rows_of_their_own(tmp_path):
    train_cli(tmp_path / "run", "logging.csv=true")

    with (tmp_path / "run" / "metrics.csv").open(newline="") as file:
        table = list(csv.reader(file))
    header, body = table[0], table[1:]
    assert header[:4] == ["step", "epoch", "loss", "lr"]
    assert header[-1] == "eval_loss"  # first seen at step 3, after the train keys
    rows = [dict(zip(header, row, strict=True)) for row in body]
    train = [int(r["step"]) for r in rows if r["loss"]]
    evals = [(int(r["step"]), r["loss"], float(r["eval_loss"])) for r in rows if r["eval_loss"]]
    assert train == [1, 2, 3, 4, 5, 6]
    assert [(step, loss) for step, loss, _ in evals] == [(3, ""), (6, "")]  # rows of their own
    assert all(value > 0 for _, _, value in evals)


def test_a_key_seen_late_widens_the_file_and_hostile_keys_and_values_survive(tmp_path):
    path = tmp_path / "metrics.csv"
    trainer(tmp_path, CSVLogger(path), LateAndHostileKeys()).train()

    with path.open(newline="") as file:
        header = next(csv.reader(file))
    assert header[:2] == ["step", "epoch"]
    # first-seen order: the train keys (step 1), these (step 3), then eval_loss (step 4)
    assert header.index("loss") < header.index(HOSTILE) < header.index("eval_loss")
    assert LONG in header
    rows = read_csv_rows(path)
    train = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in train] == list(range(1, 13))  # no row lost by widening
    assert [r[HOSTILE] for r in train[:3]] == ["", "", "3.0"]
    assert {r["note"] for r in train[2:]} == {'x, "y"\nz'}
    assert not path.with_name("metrics.csv.tmp").exists()


def test_after_a_crash_and_a_resume_every_row_appears_once(tmp_path):
    path = tmp_path / "metrics.csv"
    trainer(tmp_path / "whole", CSVLogger(tmp_path / "whole.csv")).train()
    with pytest.raises(RuntimeError, match="crash at step 8"):
        trainer(tmp_path, CSVLogger(path), CrashAt(8)).train()
    assert max(int(r["step"]) for r in read_csv_rows(path)) == 7  # logged past the checkpoint

    trainer(tmp_path, CSVLogger(path), resume="auto").train()  # restored at step 5

    def table(p):
        return [(r["step"], r["loss"], r["eval_loss"]) for r in read_csv_rows(p)]

    assert table(path) == table(tmp_path / "whole.csv")  # the same rows, each once


# -- MLflow ---------------------------------------------------------------------------


def only_run(uri: str):
    client = mlflow_tracking.MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments)
    return client, run


def test_logging_mlflow_writes_params_metrics_by_step_artifacts_and_tags(tmp_path):
    out = tmp_path / "run"
    train_cli(out, "logging.mlflow=true")

    client, run = only_run((out / "mlruns").as_uri())
    assert client.get_experiment(run.info.experiment_id).name == "mlp-regression"
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "6"
    assert run.data.params["logging.mlflow"] == "True"
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in loss) == [1, 2, 3, 4, 5, 6]
    evals = client.get_metric_history(run.info.run_id, "eval/loss")
    assert sorted(m.step for m in evals) == [3, 6]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]
    checkpoint = run.data.tags["hookloop.checkpoint"]
    assert checkpoint.endswith("step-00000006") and Path(checkpoint).is_dir()
    assert run.data.tags["hookloop.status"] == "finished"
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "env-mlruns").exists()


def test_mlflow_records_a_live_set_at_its_step_and_makes_hostile_keys_valid(tmp_path):
    from hookloop.callbacks.mlflow_logger import MLflowLogger, mlflow_name

    uri = (tmp_path / "store").as_uri()
    logger = MLflowLogger(uri, experiment="steered")
    trainer(tmp_path / "run", logger, Steer(), LateAndHostileKeys()).train()

    client, run = only_run(uri)
    assert run.data.tags["set.step4.lr"] == "0.01 -> 0.02 (test)"
    lr = client.get_metric_history(run.info.run_id, "set/lr")
    assert [(m.step, m.value) for m in lr] == [(4, 0.02)]
    hostile = client.get_metric_history(run.info.run_id, mlflow_name(f"train/{HOSTILE}"))
    assert sorted(m.step for m in hostile) == list(range(3, 13))
    long_name = mlflow_name(f"train/{LONG}")
    assert len(long_name) == 250 and long_name in run.data.metrics
    assert "train/note" not in run.data.metrics  # text is no metric


def test_a_resumed_run_continues_the_same_mlflow_run_without_duplicate_points(tmp_path):
    from hookloop.callbacks.mlflow_logger import MLflowLogger

    uri = (tmp_path / "store").as_uri()
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash at step 8"):
        trainer(out, MLflowLogger(uri), CrashAt(8)).train()
    client, crashed = only_run(uri)
    assert crashed.info.status == "FAILED"
    before = client.get_metric_history(crashed.info.run_id, "train/loss")
    assert sorted(m.step for m in before) == list(range(1, 8))  # past the checkpoint at 5

    trainer(out, MLflowLogger(uri), resume="auto").train()

    client, run = only_run(uri)  # still one run: the same one, continued
    assert run.info.run_id == crashed.info.run_id and run.info.status == "FINISHED"
    after = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in after) == list(range(1, 13))  # each step once
    by_step = {m.step: m.value for m in after}
    assert all(by_step[m.step] == m.value for m in before)


def test_a_missing_mlflow_names_the_extra(monkeypatch):
    import builtins

    from hookloop.callbacks.mlflow_logger import MLflowLogger
    from hookloop.errors import MissingExtraError

    real_import = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    for module in [m for m in sys.modules if m.split(".")[0] == "mlflow"]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(MissingExtraError, match=r"hookloop\[mlflow\]"):
        MLflowLogger()


def test_a_rewind_cuts_the_csv_back_and_marks_the_mlflow_run(tmp_path):
    from _rewind_job import build as rewinding_run
    from hookloop.callbacks.mlflow_logger import MLflowLogger

    uri = (tmp_path / "store").as_uri()
    path = tmp_path / "metrics.csv"
    run, _ = rewinding_run(tmp_path, callbacks=[CSVLogger(path), MLflowLogger(uri)])
    run.train()  # the loss spikes at step 8; the run goes back to step 6 and on to 14

    losses = [(int(r["step"]), float(r["loss"])) for r in read_csv_rows(path) if r["loss"]]
    assert [step for step, _ in losses] == list(range(1, 15))  # the spike's row was cut
    assert max(loss for _, loss in losses) < 100
    client, mlrun = only_run(uri)
    assert mlrun.data.tags["rewind.1"] == "8 -> 6"
    points = sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss"))
    assert points == sorted([*range(1, 15), 7, 8])  # MLflow keeps the old 7 and 8 beside the new
