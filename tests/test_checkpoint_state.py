"""Checkpoints of named state: written and read without a Trainer, and in the old format."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hookloop import Callback, Config, Trainer
from hookloop.checkpoint import (
    CallbackStates,
    CheckpointError,
    CheckpointManager,
    RNGState,
    SavePolicy,
    load_weights,
)
from hookloop.checkpoint.state import torch_load
from hookloop.testing import TinyModel, ToyData

LEGACY = Path(__file__).parent / "data" / "checkpoint_v0"


class Tally:
    """A plain object with state: no Callback, no Trainer."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _named_state(model: torch.nn.Module, counter: Tally) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "counter": counter, "rng": RNGState()}


def test_named_state_saves_and_loads_without_a_trainer(tmp_path):
    model, counter = TinyModel(seed=1), Tally()
    counter.n = 7
    state = _named_state(model, counter)
    manager = CheckpointManager(tmp_path / "checkpoints", SavePolicy())
    path = manager.save(state, step=5, epoch=0, config={"seed": 3})
    draw_after_save = torch.rand(3)

    assert path == tmp_path / "checkpoints" / "step-00000005"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.yaml",
        "manifest.json",
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.pt",
    ]
    saved = torch_load(path / "trainer_state.pt", torch.device("cpu"))
    assert saved["counter"] == {"n": 7} and len(saved["rng_per_rank"]) == 1

    fresh_model, fresh_counter = TinyModel(seed=2), Tally()
    fresh = {
        "model": fresh_model,
        "optimizer": torch.optim.AdamW(fresh_model.parameters(), lr=0.1),
        "counter": fresh_counter,
        "rng": RNGState(),
    }
    loaded = CheckpointManager(tmp_path / "checkpoints", SavePolicy()).load("auto", fresh)

    assert loaded == path
    assert fresh_counter.n == 7
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        fresh["optimizer"].state_dict()["state"][0]["exp_avg"],
        state["optimizer"].state_dict()["state"][0]["exp_avg"],
    )
    assert torch.equal(torch.rand(3), draw_after_save)  # the RNG continues where it was saved


def test_the_same_step_is_written_once(tmp_path):
    state = _named_state(TinyModel(), Tally())
    manager = CheckpointManager(tmp_path, SavePolicy())
    assert manager.save(state, step=1, epoch=0) is not None
    assert manager.save(state, step=1, epoch=0) is None


def test_state_that_cannot_be_loaded_safely_is_refused_naming_the_entry(tmp_path):
    state = _named_state(TinyModel(), Tally())
    state["callbacks"] = CallbackStates({"Bad": _Holding(object())})
    with pytest.raises(CheckpointError, match=r"callbacks\['Bad'\]"):
        CheckpointManager(tmp_path, SavePolicy()).save(state, step=1, epoch=0)
    assert not (tmp_path / "step-00000001").exists()


class _Holding:
    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_a_model_that_does_not_fit_is_one_checkpoint_error_for_resume_and_finetune(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", SavePolicy())
    path = manager.save(_named_state(TinyModel(), Tally()), step=1, epoch=0)
    wider = TinyModel(hidden=16)
    other = {"model": wider, "optimizer": torch.optim.SGD(wider.parameters(), lr=0.1)}

    with pytest.raises(CheckpointError, match="do not fit the model: size mismatch") as on_resume:
        manager.load(str(path), other)
    with pytest.raises(CheckpointError, match="do not fit the model: size mismatch") as on_finetune:
        load_weights(wider, tmp_path)  # a run directory: its checkpoints/latest

    for err in (on_resume.value, on_finetune.value):
        assert isinstance(err, ValueError)  # the CLI reports it in one line, exit 2
        assert "model.safetensors" in str(err)


# -- a checkpoint written by the code before named state still resumes -------------
#
# tests/data/checkpoint_v0 was written by hookloop at commit 3feb935 (before the
# checkpoint module took named state) from the run that _legacy_trainer builds, with
# checkpoint.every=3; final-model.safetensors is that run's weights after step 6.


class Counter(Callback):
    """Named as the callback that wrote the legacy checkpoint's state."""

    def __init__(self) -> None:
        self.seen = 0

    def on_train_step_end(self, ctx) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _legacy_trainer(out: Path, resume: str | None = None) -> tuple[Trainer, Counter]:
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.handle_signals = False
    cfg.train.log_every = 2
    cfg.train.grad_accum = 2
    cfg.train.max_steps = 6
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    counter = Counter()
    trainer = Trainer(
        model,
        optimizer,
        train_data=ToyData(n=32),
        config=cfg,
        callbacks=[counter],
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        loss_fn=torch.nn.functional.mse_loss,
        out_dir=out,
        resume=resume,
    )
    trainer.callbacks.user_state["note"] = 1
    return trainer, counter


def test_a_checkpoint_from_before_named_state_resumes_exactly(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(LEGACY, run)
    logged: list[tuple[int, float]] = []
    trainer, counter = _legacy_trainer(run, resume="auto")
    trainer.callbacks.register(
        "on_log", lambda ctx: logged.append((ctx.state.step, ctx.logs["loss"]))
    )

    result = trainer.train()

    assert (result.step, counter.seen) == (6, 6)  # 3 restored + 3 trained
    assert trainer.ctx.run.resumed_from == run / "checkpoints" / "step-00000003"
    expected = load_file(str(LEGACY / "final-model.safetensors"))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    fresh, _ = _legacy_trainer(tmp_path / "fresh")
    fresh_logs: list[tuple[int, float]] = []
    fresh.callbacks.register(
        "on_log", lambda ctx: fresh_logs.append((ctx.state.step, ctx.logs["loss"]))
    )
    fresh.train()
    assert logged == [entry for entry in fresh_logs if entry[0] > 3]
