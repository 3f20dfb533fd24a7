"""A log backend built on hookloop.callbacks.logger.Logger implements only "write a record"
and "cut back to a step" and still keeps every logger's promises in real runs: each step
once after a crash or a stop and a resume, a rewind cut back and recorded, an end record
after an exception, nothing written by ranks other than 0, tensors read at the log. And the
loggers rebuilt on it resume the checkpoints their earlier versions wrote."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from _rewind_job import build as rewinding_run
from hookloop import (
    Callback,
    CallbackContext,
    CallbackManager,
    Config,
    DataConfig,
    TrainConfig,
    Trainer,
)
from hookloop.callbacks import JsonLogger, read_jsonl
from hookloop.callbacks.logger import Logger, Record
from hookloop.callbacks.tensorboard import TBLogger
from hookloop.state import Progress, Rewind, RunInfo, TrainState
from hookloop.testing import TinyModel, ToyData
from test_logging import tb_scalars


class CsvLogger(Logger):
    """A whole backend: one CSV row per record; cut by byte offset, or by step without one."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def write(self, record: Record) -> None:
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([record.kind, record.step, json.dumps(record.values)])

    def position(self) -> dict:
        return {"bytes": self.path.stat().st_size if self.path.exists() else 0}

    def cut(self, step: int, saved: dict | None) -> None:
        if not self.path.exists():
            return
        if saved is not None:  # exactly where the checkpoint was taken
            os.truncate(self.path, saved["bytes"])
            return
        kept = [r for r in csv.reader(self.path.read_text().splitlines()) if int(r[1]) <= step]
        with self.path.open("w", newline="") as f:
            csv.writer(f).writerows(kept)


def rows(path: Path) -> list[tuple[str, int, dict]]:
    with path.open(newline="") as f:
        return [(kind, int(step), json.loads(values)) for kind, step, values in csv.reader(f)]


def history(path: Path) -> list[tuple[str, int, object]]:
    """What a reader compares across runs: each record's kind, step and number (no times)."""
    shown = {"train": "loss", "eval": "eval_loss", "end": "status"}
    return [(kind, step, values[shown[kind]]) for kind, step, values in rows(path) if kind in shown]


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step:
            ctx.control.request_stop("asked to stop")


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
    return Trainer(
        TinyModel(), train_data=ToyData(n=256), eval_data=ToyData(n=16, seed=1),
        loss_fn=TinyModel.loss_fn, config=cfg, callbacks=list(callbacks), out_dir=str(out),
        resume=resume,
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple[str, int, object]]:
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer(out, CsvLogger(out / "log.csv")).train()
    return history(out / "log.csv")


def test_a_backend_gets_a_start_every_log_and_evaluation_and_the_end(tmp_path, uninterrupted):
    trainer(tmp_path, CsvLogger(tmp_path / "log.csv")).train()

    records = rows(tmp_path / "log.csv")
    assert [(kind, step) for kind, step, _ in records] == [
        ("start", 0), *[("train", s) for s in range(1, 5)], ("eval", 4),
        *[("train", s) for s in range(5, 9)], ("eval", 8),
        *[("train", s) for s in range(9, 13)], ("eval", 12), ("end", 12),
    ]  # fmt: skip
    start, end = records[0][2], records[-1][2]
    assert start["pid"] == os.getpid() and start["resumed"] is False and start["max_steps"] == 12
    assert end == {"status": "finished", "stop_reason": "max_steps"}
    assert history(tmp_path / "log.csv") == uninterrupted  # the same numbers every time


@pytest.mark.parametrize(
    ("interruption", "checkpoint", "end"),
    [(CrashAt(8), 5, ("end", 8, "failed")), (StopAt(7), 7, ("end", 7, "stopped"))],
    ids=["crash", "stop"],
)
def test_after_an_interruption_and_a_resume_a_backend_holds_what_an_uninterrupted_run_wrote(
    tmp_path, uninterrupted, interruption, checkpoint, end
):
    log = tmp_path / "log.csv"
    with contextlib.suppress(RuntimeError):  # the crash; a stop ends in an orderly way
        trainer(tmp_path, CsvLogger(log), interruption).train()
    assert history(log)[-1] == end  # the end record says how the first part ended
    if end[2] == "failed":
        assert rows(log)[-1][2]["error"] == "RuntimeError: crash at step 8"

    trainer(tmp_path, CsvLogger(log), resume="auto").train()

    assert history(log) == uninterrupted  # no step lost, none twice, the same numbers
    starts = [(step, values["resumed"]) for kind, step, values in rows(log) if kind == "start"]
    assert starts == [(0, False), (checkpoint, True)]


def test_a_resume_that_finds_no_checkpoint_cuts_a_backend_back_by_step(tmp_path, uninterrupted):
    log = tmp_path / "log.csv"
    with pytest.raises(RuntimeError, match="crash at step 4"):
        trainer(tmp_path, CsvLogger(log), CrashAt(4)).train()
    assert not (tmp_path / "checkpoints").exists()

    trainer(tmp_path, CsvLogger(log), resume="auto").train()

    assert history(log) == uninterrupted
    assert [step for kind, step, _ in rows(log) if kind == "start"] == [0, 0]


def test_a_rewind_cuts_a_backend_back_to_the_restored_step_and_records_the_rewind(tmp_path):
    log = tmp_path / "log.csv"
    run, _ = rewinding_run(tmp_path, callbacks=[CsvLogger(log)])  # spikes at step 8
    run.train()

    records = rows(log)
    train = [(step, values["loss"]) for kind, step, values in records if kind == "train"]
    assert [step for step, _ in train] == list(range(1, 15))
    assert max(loss for _, loss in train) < 100  # the spike's record was cut
    (rewind,) = [(step, values) for kind, step, values in records if kind == "rewind"]
    assert rewind[0] == 6
    assert {k: rewind[1][k] for k in ("from_step", "to_step", "since_step")} == {
        "from_step": 8,
        "to_step": 6,
        "since_step": 8,
    }
    # JsonLogger, in the same run, wrote the same records
    kinds = [(r["kind"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert kinds == [(kind, step) for kind, step, _ in records]


def test_ranks_other_than_zero_neither_write_nor_cut_a_shared_log(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("start,0,{}\ntrain,1,{}\ntrain,2,{}\n")  # rank 0's, in a shared directory
    before = log.read_bytes()
    logger = CsvLogger(log)
    manager = CallbackManager(logger)
    progress = Progress()
    progress.rank, progress.step, progress.in_training = 1, 1, True
    ctx = CallbackContext(state=TrainState(progress), run=RunInfo(resume="auto"))
    logger.load_state_dict({"bytes": 0})
    manager.fire("on_checkpoint_load", ctx)
    manager.fire("on_train_start", ctx)
    ctx.logs = {"loss": torch.tensor(0.5)}
    manager.fire("on_log", ctx)
    ctx.logs, ctx.metrics = None, {"eval_loss": 0.25}
    manager.fire("on_eval_end", ctx)
    manager.fire("on_checkpoint_save", ctx)
    ctx.rewind = Rewind(1, 2, 1, 2, 0, "ckpt", "spike")
    manager.fire("on_checkpoint_load", ctx)
    manager.fire("on_train_end", ctx)
    manager.fire_exception(ctx, RuntimeError("boom"))

    assert log.read_bytes() == before


def test_a_tensor_in_the_logs_reaches_a_backend_as_the_number_it_held_at_the_log(tmp_path):
    value = torch.zeros(())

    class Producer(Callback):
        priority = 30

        def on_before_log(self, ctx) -> None:
            value.fill_(ctx.state.step)
            ctx.logs["tensor"] = value

    class LaterChange(Callback):
        priority = 200  # after every logger has seen the log

        def on_log(self, ctx) -> None:
            value.fill_(-1.0)

    trainer(tmp_path, CsvLogger(tmp_path / "log.csv"), Producer(), LaterChange()).train()

    train = [values for kind, _, values in rows(tmp_path / "log.csv") if kind == "train"]
    assert [v["tensor"] for v in train] == [float(s) for s in range(1, 13)]


def test_a_backend_without_write_or_cut_cannot_be_built():
    class NoCut(Logger):
        def write(self, record: Record) -> None: ...

    with pytest.raises(TypeError, match=r"abstract method.*cut"):
        NoCut()


# -- a checkpoint written before the loggers had a base class still resumes ----------------
#
# tests/data/logger_checkpoint_v0 was written by hookloop at commit c77a6fd (JsonLogger,
# TBLogger and WandbLoggingCallback each with their own handlers) from the run `trainer`
# builds, with the three loggers and CrashAt(8), in a directory named `run` (W&B offline;
# its wandb/ directory is left out): it holds the step-5 checkpoint with the loggers'
# state ({"offset": 1050}, {"log_dir": "run/tb"}, {"run_id": "48nizboz"}), the JSON log
# and the TensorBoard events of steps 1-7 and the end record of the crash.

LEGACY = Path(__file__).parent / "data" / "logger_checkpoint_v0"


def test_logger_state_from_before_the_logger_base_resumes_json_and_tensorboard(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(LEGACY, run)
    fresh = tmp_path / "fresh"
    trainer(fresh, JsonLogger(fresh / "metrics.jsonl")).train()
    expected = [(r["kind"], r["step"], r.get("loss")) for r in read_jsonl(fresh / "metrics.jsonl")]
    with warnings.catch_warnings():  # the checkpoint's W&B state has no callback here
        warnings.filterwarnings("ignore", "hookloop resume: saved state for callback")
        trainer(run, JsonLogger(run / "metrics.jsonl"), TBLogger(run / "tb"), resume="auto").train()

    resumed = read_jsonl(run / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in resumed if r["kind"] == "start"] == [
        ("start", 0),
        ("start", 5),
    ]
    got = [(r["kind"], r["step"], r.get("loss")) for r in resumed if r["kind"] != "start"]
    assert got == [e for e in expected if e[0] != "start"]  # bitwise: the same losses
    loss = tb_scalars(run / "tb", "train/loss")
    assert [step for step, _ in loss] == list(range(1, 13))
    json_loss = {r["step"]: r["loss"] for r in resumed if r["kind"] == "train"}
    assert all(abs(v - json_loss[s]) <= 1e-6 * abs(json_loss[s]) for s, v in loss)


@pytest.mark.slow  # W&B runs its own writer process
def test_logger_state_from_before_the_logger_base_resumes_the_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    from hookloop.callbacks.wandb_logger import (
        WandbLoggingCallback,
        offline_history,
        read_wandb_records,
    )

    run = tmp_path / "run"
    shutil.copytree(LEGACY, run)
    with warnings.catch_warnings():  # the checkpoint's TensorBoard state has no callback here
        warnings.filterwarnings("ignore", "hookloop resume: saved state for callback")
        wandb = WandbLoggingCallback(project="p")
        trainer(run, JsonLogger(run / "metrics.jsonl"), wandb, resume="auto").train()

    logged = offline_history(run / "wandb", wait_s=30)
    assert [r["_step"] for r in logged if "train/loss" in r] == list(range(6, 13))
    (file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    (started,) = [r.run for r in read_wandb_records(file) if r.WhichOneof("record_type") == "run"]
    assert started.run_id == "48nizboz" and started.branch_point.value == 5
