"""Local (non-persistent) checkpoints: frequent, only the newest kept, never the run's
output; ``--resume auto`` takes the newest intact of local and persistent."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _quiet import SERVICES_OFF
from hookloop import Callback, Config, DataConfig, TrainConfig, Trainer
from hookloop.app.cli import main
from hookloop.callbacks import JsonLogger, read_jsonl
from hookloop.callbacks.defaults import default_callbacks
from hookloop.checkpoint import FAULT_ENV
from hookloop.entry import build_trainer
from hookloop.recipes import resolve_config
from hookloop.testing import TinyModel, ToyData, assert_same_checkpoint


class Crash(Callback):
    """Dies (an exception, nothing saved after it) at the end of step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.at:
            raise RuntimeError(f"simulated crash at step {self.at}")


class Saves(Callback):
    """The steps ``on_checkpoint_save`` announced."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_checkpoint_save(self, ctx) -> None:
        self.steps.append(ctx.state.step)


def run(out: Path, *, resume=None, callbacks=(), max_steps=10, **checkpoint) -> Trainer:
    """TinyModel on 32 samples (8 steps an epoch), shuffled, persistent checkpoints every 4."""
    cfg = Config(
        train=TrainConfig(max_steps=max_steps, log_every=1, handle_signals=False, device="cpu"),
        data=DataConfig(batch_size=4),
    )
    cfg.checkpoint.every = 4
    cfg.checkpoint.keep_last = None
    cfg.checkpoint.local_every = 1
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=32), loss_fn=TinyModel.loss_fn, config=cfg,
        out_dir=str(out), resume=resume,
        callbacks=[JsonLogger(out / "metrics.jsonl"), *callbacks],
    )  # fmt: skip
    try:
        trainer.train()
    except RuntimeError as err:
        if "simulated crash" not in str(err):
            raise
    return trainer


def weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def steps_logged(out: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]


def local_steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "local_checkpoints").iterdir() if p.name.startswith("s"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[torch.Tensor]:
    return weights(run(tmp_path_factory.mktemp("uninterrupted"), local_every=None))


def test_only_the_newest_local_checkpoint_is_kept_and_it_is_never_the_runs_output(tmp_path):
    saves = Saves()
    run(tmp_path, callbacks=[saves], max_steps=7)
    assert local_steps(tmp_path) == ["step-00000007"]  # saved at 1, 2, 3, 5, 6, 7; one kept
    persistent = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert persistent == ["step-00000004", "step-00000007"]  # retention never saw the local
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000007"
    assert (tmp_path / "local_checkpoints" / "latest").read_text() == "step-00000007"
    assert saves.steps == [4, 7]  # local saves are not announced as the run's checkpoints


def test_resume_auto_takes_a_newer_local_checkpoint_over_an_older_persistent_one(
    tmp_path, uninterrupted
):
    run(tmp_path, callbacks=[Crash(at=7)])  # persistent at 4, local at 6; step 7 lost
    assert local_steps(tmp_path) == ["step-00000006"]
    resumed = run(tmp_path, resume="auto")
    assert resumed.ctx.run.resumed_from == tmp_path / "local_checkpoints" / "step-00000006"
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), uninterrupted, strict=True))
    assert steps_logged(tmp_path) == list(range(1, 11))  # each step once


@pytest.mark.parametrize("part", ["model.safetensors", "manifest.json"])
def test_a_damaged_local_checkpoint_falls_back_to_the_persistent_one_and_says_so(
    tmp_path, uninterrupted, part
):
    run(tmp_path, callbacks=[Crash(at=7)])
    local = tmp_path / "local_checkpoints" / "step-00000006"
    target = local / part
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="local checkpoint is damaged") as caught:
        resumed = run(tmp_path, resume="auto")
    message = str(caught[0].message)
    persistent = tmp_path / "checkpoints" / "step-00000004"
    assert str(local) in message and str(persistent) in message
    assert resumed.ctx.run.resumed_from == persistent
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), uninterrupted, strict=True))
    assert steps_logged(tmp_path) == list(range(1, 11))


def test_a_run_killed_before_its_first_persistent_checkpoint_resumes_from_the_local_one(
    tmp_path, uninterrupted
):
    run(tmp_path, callbacks=[Crash(at=3)])  # local at 2, no persistent checkpoint yet
    assert not list((tmp_path / "checkpoints").glob("step-*"))
    resumed = run(tmp_path, resume="auto")
    assert resumed.ctx.run.resumed_from == tmp_path / "local_checkpoints" / "step-00000002"
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), uninterrupted, strict=True))


def test_a_damaged_local_checkpoint_with_no_persistent_one_refuses_to_start_over(tmp_path):
    run(tmp_path, callbacks=[Crash(at=3)])  # local at 2, no persistent checkpoint yet
    (tmp_path / "local_checkpoints" / "step-00000002" / "optimizer.pt").unlink()
    refused = pytest.raises(ValueError, match=r"no intact checkpoint to resume.*allow-restart")
    with pytest.warns(UserWarning, match="local checkpoint is damaged"), refused:
        run(tmp_path, resume="auto")


def test_a_new_run_over_another_runs_local_checkpoints_is_refused(tmp_path):
    shared = tmp_path / "node-local"
    run(tmp_path / "a", local_dir=str(shared), max_steps=3)
    with pytest.raises(ValueError, match="already holds local checkpoints"):
        run(tmp_path / "b", local_dir=str(shared), max_steps=3)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"local_every": 0}, r"checkpoint.local_every must be an int >= 1, got 0"),
        ({"local_every": True}, r"checkpoint.local_every must be an int >= 1"),
        ({"local_every": 2, "local_dir": ""}, r"checkpoint.local_dir must be a directory path"),
        ({"local_every": None, "local_dir": "/tmp/x"}, r"local_every is null.*local_every=N"),
    ],
)
def test_bad_local_checkpoint_settings_are_refused_naming_what_is_allowed(settings, message):
    cfg = Config()
    for key, value in settings.items():
        setattr(cfg.checkpoint, key, value)
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_local_dir_may_not_be_the_persistent_checkpoints_folder(tmp_path):
    with pytest.raises(ValueError, match="local checkpoints need a folder of their own"):
        run(tmp_path, local_dir=str(tmp_path / "checkpoints"), max_steps=2)


@pytest.mark.slow  # a `hookloop train` process
def test_hookloop_train_saves_and_resumes_local_checkpoints(tmp_path):
    # Persistent saves on the loop's thread: the process then dies inside step 8's save for
    # sure (a background save may reach its fault only after step 9 has run and saved).
    overrides = [
        "train.max_steps=9", "train.log_every=1", "data.train_samples=64", "data.batch_size=8",
        "checkpoint.every=4", "checkpoint.local_every=1", "checkpoint.async_save=false",
        "logging.progress=false", "callbacks.info=false", *SERVICES_OFF,
    ]  # fmt: skip

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    # The process dies inside the persistent save of step 8: the local one of step 7 is newest.
    cmd = [sys.executable, "-m", "hookloop", "train", "--out", str(cut)]
    cmd += ["--recipe", "mlp-regression", *overrides]
    env = {**os.environ, FAULT_ENV: "files_written@8"}
    proc = zygote.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 86, proc.stderr[-3000:]
    assert local_steps(cut) == ["step-00000007"]
    assert (cut / "checkpoints" / "latest").read_text() == "step-00000004"
    with contextlib.redirect_stderr(io.StringIO()) as err:  # the resume, in this process
        code = main(["train", "--out", str(cut), "--recipe", "mlp-regression", *overrides,
                     "--resume", "auto"])  # fmt: skip
    assert code == 0, err.getvalue()[-3000:]
    records = read_jsonl(cut / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 10))
    assert [r["step"] for r in records if r["kind"] == "start"] == [0, 7]
    # The same run uninterrupted, in this process (the command builds it the same way).
    cfg = resolve_config("mlp-regression", None, overrides)
    build_trainer(cfg, callbacks=default_callbacks(cfg, whole), out_dir=whole).train()
    last = "checkpoints/step-00000009"
    assert_same_checkpoint(whole / last, cut / last)
