"""JSON, TensorBoard and W&B logging: written by real runs, read back with each tool's reader."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from hookloop import Callback, Config, Trainer
from hookloop.app.runs import summarize_run
from hookloop.callbacks import JsonLogger, read_jsonl
from hookloop.callbacks.tensorboard import ResumableSummaryWriter, TBLogger
from hookloop.callbacks.wandb_logger import (
    WandbLoggingCallback,
    offline_history,
    offline_run_files,
    read_wandb_records,
)
from hookloop.testing import TinyModel, ToyData

# -- helpers ----------------------------------------------------------------------------


class CrashAt(Callback):
    """Dies at the end of step ``step``: a stand-in for a crash between checkpoints."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


class AddsThroughput(Callback):
    """A metric producer: what other callbacks put in ctx.logs must reach every logger."""

    priority = 30

    def on_before_log(self, ctx) -> None:
        ctx.logs["samples_per_s"] = 100.0 + ctx.state.step


def config(max_steps: int, *, log_every: int = 1, eval_every: int | None = None) -> Config:
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.handle_signals = False
    cfg.train.max_steps = max_steps
    cfg.train.log_every = log_every
    cfg.train.eval_every = eval_every
    cfg.train.eval_at_epoch_end = False
    return cfg


def trainer(out: Path, callbacks, cfg: Config, resume: str | None = None) -> Trainer:
    return Trainer(
        TinyModel(),
        train_data=ToyData(n=256),
        eval_data=ToyData(n=16, seed=1),
        config=cfg,
        callbacks=callbacks,
        loss_fn=TinyModel.loss_fn,
        out_dir=str(out),
        resume=resume,
    )


def json_steps(path: Path, kind: str = "train") -> list[int]:
    return [r["step"] for r in read_jsonl(path) if r["kind"] == kind]


def tb_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows it (its own reader, purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_text(log_dir: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")
    ]


def raw_event_steps(log_dir: Path, tag: str) -> list[int]:
    """Steps of every ``tag`` event in the files, purged or not (no accumulator)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if any(v.tag == tag for v in event.summary.value):
                steps.append(event.step)
    return steps


# -- JSON log ----------------------------------------------------------------------------


def test_json_log_records_start_every_log_and_eval_and_the_end(tmp_path):
    log = tmp_path / "metrics.jsonl"
    trainer(tmp_path, [JsonLogger(log), AddsThroughput()], config(4, eval_every=2)).train()

    records = read_jsonl(log)
    assert [(r["kind"], r["step"]) for r in records] == [
        ("start", 0), ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4),
        ("eval", 4), ("end", 4),
    ]  # fmt: skip
    assert all({"time", "step", "epoch"} <= r.keys() for r in records)
    train = [r for r in records if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) and r["lr"] > 0 for r in train)
    assert [r["samples_per_s"] for r in train] == [101.0, 102.0, 103.0, 104.0]
    assert all(math.isfinite(r["eval_loss"]) for r in records if r["kind"] == "eval")
    assert records[0]["pid"] == os.getpid() and records[0]["resumed"] is False
    assert records[-1]["status"] == "finished" and records[-1]["stop_reason"] == "max_steps"


def test_json_log_end_record_says_failed_with_the_error_after_an_exception(tmp_path):
    log = tmp_path / "metrics.jsonl"
    with pytest.raises(RuntimeError, match="crash at step 2"):
        trainer(tmp_path, [JsonLogger(log), CrashAt(2)], config(5)).train()

    end = read_jsonl(log)[-1]
    assert end["kind"] == "end" and end["status"] == "failed"
    assert "crash at step 2" in end["error"]


def test_json_log_stays_readable_when_the_writer_dies_mid_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    trainer(tmp_path, [JsonLogger(log)], config(3)).train()
    with log.open("a") as f:
        f.write('{"kind": "train", "time": 1.0, "st')  # a SIGKILL in the middle of a write

    assert json_steps(log) == [1, 2, 3]


# -- kill + resume: every step once, in the JSON log and in TensorBoard ------------------------


def test_crash_and_resume_leaves_each_step_once_in_json_and_tensorboard(tmp_path):
    cfg = config(12)
    cfg.checkpoint.every = 5
    log, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    with pytest.raises(RuntimeError):
        trainer(tmp_path, [JsonLogger(log), TBLogger(tb), CrashAt(8)], cfg).train()
    assert json_steps(log) == [1, 2, 3, 4, 5, 6, 7]  # steps 6 and 7 are after the checkpoint

    result = trainer(tmp_path, [JsonLogger(log), TBLogger(tb)], cfg, resume="auto").train()

    assert result.step == 12
    assert json_steps(log) == list(range(1, 13))
    loss = tb_scalars(tb, "train/loss")
    assert [step for step, _ in loss] == list(range(1, 13))
    json_loss = {r["step"]: r["loss"] for r in read_jsonl(log) if r["kind"] == "train"}
    assert all(math.isclose(v, json_loss[s], rel_tol=1e-6) for s, v in loss)
    # The first session's steps 6 and 7 are still in its event file: the purge hides them.
    assert raw_event_steps(tb, "train/loss").count(6) == 2
    assert summarize_run(tmp_path).status == "finished"


def test_resume_that_finds_no_checkpoint_starts_the_logs_over(tmp_path):
    log, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    with pytest.raises(RuntimeError):
        trainer(tmp_path, [JsonLogger(log), TBLogger(tb), CrashAt(4)], config(6)).train()
    assert not (tmp_path / "checkpoints").exists()

    trainer(tmp_path, [JsonLogger(log), TBLogger(tb)], config(6), resume="auto").train()

    assert json_steps(log) == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tb_scalars(tb, "train/loss")] == [1, 2, 3, 4, 5, 6]


MLP_RUN_ARGS = [
    "train.max_steps=40", "train.log_every=1", "train.eval_every=1000", "checkpoint.every=10",
    "logging.progress=false", "data.train_samples=2048",
]  # fmt: skip

KILLABLE_RUN = textwrap.dedent(
    f"""
    import sys, time
    from pathlib import Path
    from hookloop import Callback
    from hookloop.callbacks import JsonLogger
    from hookloop.callbacks.tensorboard import TBLogger
    from hookloop.recipes import resolve_config
    from hookloop.entry import build_trainer

    class Slow(Callback):  # and from step 26 on, still: the kill after step 24 lands first
        def on_train_step_end(self, ctx):
            if ctx.state.step >= 26:
                records.flush()  # steps 21-25 reach the file (past the step-20 checkpoint)
            time.sleep(0.05 if ctx.state.step < 26 else 3600)

    out = Path(sys.argv[1])
    cfg = resolve_config("mlp-regression", None, {MLP_RUN_ARGS!r})
    records = JsonLogger(out / "metrics.jsonl")
    callbacks = [records, TBLogger(out / "tb"), Slow()]
    build_trainer(cfg, callbacks=callbacks, out_dir=out).train()
    """
)


@pytest.mark.slow
def test_sigkill_then_resume_leaves_one_scalar_per_step_in_tensorboard(tmp_path):
    from hookloop.entry import build_trainer
    from hookloop.recipes import resolve_config

    run = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(KILLABLE_RUN)
    proc = zygote.Popen(
        [sys.executable, str(script), str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        # Bounded, and generous: on a loaded machine the run's start alone can take a minute.
        deadline, steps = time.monotonic() + 300, []
        while time.monotonic() < deadline and proc.poll() is None:
            steps = json_steps(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
            if steps and steps[-1] >= 24:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert steps and steps[-1] >= 24, f"the run logged only up to {steps[-1:]} in 300 s"
        proc.kill()  # SIGKILL: no handler runs, no end record, nothing flushed on the way out
    finally:
        proc.kill()
        proc.wait()
    assert json_steps(run / "metrics.jsonl")[-1] > 20  # logged past the step-20 checkpoint
    assert summarize_run(run).status == "killed"

    cfg = resolve_config("mlp-regression", None, MLP_RUN_ARGS)
    callbacks = [JsonLogger(run / "metrics.jsonl"), TBLogger(run / "tb")]
    build_trainer(cfg, callbacks=callbacks, out_dir=run, resume="auto").train()

    assert json_steps(run / "metrics.jsonl") == list(range(1, 41))
    assert [s for s, _ in tb_scalars(run / "tb", "train/loss")] == list(range(1, 41))
    assert summarize_run(run).status == "finished"


# -- TensorBoard contents ------------------------------------------------------------------


def test_tensorboard_has_every_numeric_metric_the_config_and_a_run_summary(tmp_path):
    tb = tmp_path / "tb"
    callbacks = [TBLogger(tb), AddsThroughput(), JsonLogger(tmp_path / "m.jsonl")]
    trainer(tmp_path, callbacks, config(6, log_every=2, eval_every=3)).train()

    for tag in ("train/loss", "train/lr", "train/epoch", "train/samples_per_s"):
        assert [s for s, _ in tb_scalars(tb, tag)] == [2, 4, 6], tag
    assert [s for s, _ in tb_scalars(tb, "eval/loss")] == [3, 6]
    assert tb_scalars(tb, "train/samples_per_s")[0][1] == 102.0
    [(step, text)] = tb_text(tb, "config")
    assert step == 0 and "max_steps: 6" in text and "log_every: 2" in text
    [(step, summary)] = tb_text(tb, "run/summary")
    assert step == 6 and "finished" in summary and "max_steps" in summary


def test_a_shared_writer_registered_on_its_own_serves_the_logger_and_other_callbacks(tmp_path):
    writer = ResumableSummaryWriter(tmp_path / "tb")

    class Custom(Callback):
        def on_log(self, ctx) -> None:
            writer.add_scalar("custom/double_step", 2.0 * ctx.state.step, ctx.state.step)

    trainer(tmp_path, [writer, TBLogger(writer), Custom()], config(3)).train()

    assert [v for _, v in tb_scalars(tmp_path / "tb", "custom/double_step")] == [2.0, 4.0, 6.0]
    assert [s for s, _ in tb_scalars(tmp_path / "tb", "train/loss")] == [1, 2, 3]


def test_only_rank_zero_writes_logs(tmp_path):
    from hookloop.state import CallbackContext, Progress, TrainState

    progress = Progress()
    progress.rank = 1
    ctx = CallbackContext(state=TrainState(progress), config=Config())
    ctx.logs = {"loss": 1.0}
    json_logger, tb_logger = JsonLogger(tmp_path / "m.jsonl"), TBLogger(tmp_path / "tb")
    for cb in (json_logger, tb_logger):
        cb.on_train_start(ctx)
        cb.on_log(ctx)
        cb.on_train_end(ctx)

    assert not (tmp_path / "m.jsonl").exists()
    assert not (tmp_path / "tb").exists()


# -- Weights & Biases (offline) --------------------------------------------------------------


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-default"))
    return tmp_path


def test_wandb_offline_run_has_one_row_per_log_step_with_every_metric(wandb_env):
    run_dir = wandb_env / "run"
    wb = WandbLoggingCallback(project="hookloop-tests", mode="offline")
    callbacks = [wb, AddsThroughput(), JsonLogger(run_dir / "metrics.jsonl")]
    trainer(run_dir, callbacks, config(6, log_every=2, eval_every=3)).train()

    # dir defaults to the trainer's run directory; wandb-core may still be writing the file
    rows = offline_history(run_dir / "wandb", wait_s=30)
    assert [r["_step"] for r in rows] == [2, 3, 4, 6]
    logged = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"}
    for row in rows:
        if row["_step"] in logged:
            expected = logged[row["_step"]]
            assert math.isclose(row["train/loss"], expected["loss"], rel_tol=1e-6)
            assert row["train/lr"] == expected["lr"]
            assert row["train/samples_per_s"] == 100.0 + row["_step"]
    by_step = {r["_step"]: r for r in rows}
    assert "eval/loss" in by_step[3] and "train/loss" not in by_step[3]
    assert {"eval/loss", "train/loss"} <= by_step[6].keys()  # same step: one row
    assert wb.run is None  # finished at train end


def test_wandb_run_gets_the_resolved_config(wandb_env):
    run_dir = wandb_env / "run"
    trainer(run_dir, [WandbLoggingCallback(project="p", mode="offline")], config(2)).train()

    offline_history(run_dir / "wandb", wait_s=30)  # until wandb-core has written it all
    [file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    saved = {}
    for record in read_wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            saved.update({item.key: json.loads(item.value_json) for item in updates})
    assert saved["train"]["max_steps"] == 2
    assert saved["optimizer"]["name"] == "adamw"


def test_wandb_resume_rewinds_the_run_to_the_checkpoint_step(wandb_env):
    run_dir = wandb_env / "run"
    cfg = config(8)
    cfg.checkpoint.every = 4
    first = WandbLoggingCallback(project="p", mode="offline")
    with pytest.raises(RuntimeError):
        trainer(run_dir, [first, CrashAt(6)], cfg).train()

    second = WandbLoggingCallback(project="p", mode="offline")
    trainer(run_dir, [second], cfg, resume="auto").train()

    files = offline_run_files(run_dir / "wandb")
    assert len(files) == 2 and files[0].name == files[1].name  # the same W&B run id
    merged = offline_history(run_dir / "wandb", wait_s=30)
    assert [r["_step"] for r in offline_history(files[0])] == [1, 2, 3, 4, 5]
    assert [r["_step"] for r in merged] == list(range(1, 9))


# -- optional packages -----------------------------------------------------------------------


def test_a_missing_wandb_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is absent
    with pytest.raises(ImportError, match=r"pip install 'hookloop\[wandb\]'"):
        WandbLoggingCallback(project="p")


def test_a_missing_tensorboard_names_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'hookloop\[tensorboard\]'"):
        TBLogger(tmp_path / "tb")


def test_require_imports_present_modules_and_names_the_extra_for_missing_ones(monkeypatch):
    from hookloop._optional import require

    assert require("torch", extra="never-needed") is torch
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"hookloop plot needs .*hookloop\[plot\]"):
        require("matplotlib", extra="plot", feature="hookloop plot")
