"""A Trainer built in Python with an ``out_dir`` shows and keeps what ``hookloop train``
does: progress on stderr, ``metrics.jsonl`` (so ``hookloop runs`` lists it),
TensorBoard, a line where a resume starts; ``default_callbacks=False`` keeps it bare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hookloop.callbacks.jsonlog import JsonLogger
from hookloop.callbacks.progress import ProgressBar
from hookloop.config import Config
from hookloop.testing import TinyModel, ToyData
from hookloop.trainer import Trainer


def config(max_steps: int = 4) -> Config:
    cfg = Config()
    cfg.train.device = "cpu"
    cfg.train.max_steps = max_steps
    cfg.train.log_every = 2
    cfg.data.batch_size = 4
    cfg.checkpoint.async_save = False
    cfg.logging.progress_interval = 0.0
    return cfg


def trainer(out_dir: Path | None, max_steps: int = 4, **kwargs) -> Trainer:
    return Trainer(
        TinyModel(),
        train_data=ToyData(n=32),
        loss_fn=TinyModel.loss_fn,
        config=config(max_steps),
        out_dir=out_dir,
        **kwargs,
    )


def hookloop_runs(root: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "hookloop", "runs", str(root)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_python_run_with_out_dir_logs_shows_progress_and_is_listed(tmp_path, capfd):
    run = tmp_path / "runs" / "mine"
    result = trainer(run).train()
    err = capfd.readouterr().err
    assert result.step == 4
    assert "run info:" in err  # the summary at the start
    assert "loss" in err and "step" in err  # progress rows on stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4]
    assert any((run / "tb").iterdir())  # TensorBoard events
    listed = hookloop_runs(tmp_path / "runs")
    assert "mine" in listed and "finished" in listed


def test_default_callbacks_false_keeps_the_run_bare(tmp_path, capfd):
    run = tmp_path / "runs" / "bare"
    trainer(run, default_callbacks=False).train()
    assert capfd.readouterr().err == ""
    assert not (run / "metrics.jsonl").exists() and not (run / "tb").exists()
    assert (run / "checkpoints").is_dir()  # out_dir still holds the checkpoints
    assert "bare" not in hookloop_runs(tmp_path / "runs")


def test_without_out_dir_nothing_is_added_unless_asked(tmp_path, capfd):
    trainer(None).train()
    assert capfd.readouterr().err == ""
    trainer(None, default_callbacks=True).train()
    assert "run info:" in capfd.readouterr().err


def test_defaults_go_beside_the_users_callbacks_and_one_of_the_same_class_replaces(tmp_path):
    own = JsonLogger(tmp_path / "mine.jsonl")
    t = trainer(tmp_path / "run", callbacks=[own])
    loggers = [cb for cb in t.callbacks.callbacks if isinstance(cb, JsonLogger)]
    assert loggers == [own]
    assert any(isinstance(cb, ProgressBar) for cb in t.callbacks.callbacks)
    t.train()
    assert (tmp_path / "mine.jsonl").is_file() and not (tmp_path / "run/metrics.jsonl").exists()


def test_a_resume_says_where_it_resumed(tmp_path, capfd):
    trainer(tmp_path, max_steps=4).train()
    capfd.readouterr()
    trainer(tmp_path, max_steps=6, resume="auto").train()
    err = capfd.readouterr().err
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    assert f"hookloop: resumed at step 4 from {ckpt}\n" in err


def test_default_callbacks_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="default_callbacks must be None, True or False"):
        trainer(None, default_callbacks="yes")
