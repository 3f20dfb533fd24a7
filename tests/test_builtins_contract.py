"""The contract every built-in callback keeps, checked for each one found in
``hookloop.callbacks`` (a new built-in is picked up without editing this file)."""

from __future__ import annotations

import inspect
import io

import pytest
import torch

import hookloop.callbacks as builtins
from hookloop import (
    Callback,
    CallbackContext,
    CallbackManager,
    Config,
    DataConfig,
    TrainConfig,
    Trainer,
)
from hookloop.testing import TinyModel, ToyData

CLASSES = sorted(
    {
        obj
        for name in builtins.__all__
        if inspect.isclass(obj := getattr(builtins, name))
        and issubclass(obj, Callback)
        and not inspect.isabstract(obj)  # a base to build on (Logger), not one to register
    },
    key=lambda cls: cls.__name__,
)


def build(cls: type, tmp_path) -> Callback:
    """Defaults where the class has them; the one required argument where it has not."""
    if cls is builtins.TextgenCallback:
        return cls(
            ["a"], generate_fn=lambda model, prompt, **kw: prompt + "!", stream=io.StringIO()
        )
    if cls is builtins.OptunaPruning:
        import optuna

        return cls(optuna.trial.FixedTrial({}))
    if cls is builtins.JsonLogger:
        return cls(tmp_path / "metrics.jsonl")
    if cls is builtins.CSVLogger:
        return cls(tmp_path / "metrics.csv")
    if cls is builtins.MLflowLogger:
        return cls((tmp_path / "mlruns").as_uri())
    if cls is builtins.ModelSummary:
        return cls(stream=io.StringIO())
    if cls in (builtins.TBLogger, builtins.ResumableSummaryWriter):
        return cls(tmp_path / "tb")
    if cls is builtins.WandbLoggingCallback:
        return cls(dir=tmp_path, mode="offline")
    if cls is builtins.ProfilerCallback:
        return cls(output_dir=tmp_path / "profile")
    if cls is builtins.ProgressBar:
        return cls(stream=io.StringIO())
    if cls is builtins.InfoCallback:
        return cls(stream=io.StringIO())
    return cls()


def fit(callback: Callback, out_dir=None, resume=None, steps: int = 4, manager=None) -> Trainer:
    cfg = Config(
        train=TrainConfig(max_steps=steps, log_every=2, eval_every=2), data=DataConfig(batch_size=4)
    )
    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=32), eval_data=ToyData(n=8, seed=1),
        loss_fn=TinyModel.loss_fn, config=cfg,
        callbacks=(manager or CallbackManager()).add(callback),
        out_dir=None if out_dir is None else str(out_dir), resume=resume,
    )  # fmt: skip
    trainer.train()
    return trainer


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


def test_every_systems_name_is_importable_from_hookloop_callbacks_or_its_dialect():
    # Names the compatible systems share with hookloop live in hookloop.callbacks; their own
    # names for native callbacks live with their dialect (hookloop.compat).
    import hookloop.compat.hf as hf
    import hookloop.compat.hpo as hpo

    for home, name in [
        (hpo, "NaNDetectionCallback"), (hpo, "OptimizerModeCallback"),
        (hpo, "GradientMonitorCallback"), (hpo, "LossPredictionCallback"),
        (hpo, "OverfitDetectionCallback"), (builtins, "WandbLoggingCallback"),
        (hpo, "PrunerCallback"), (hpo, "EarlyStoppingCallback"), (hpo, "CheckpointCallback"),
        (builtins, "DefaultMetrics"), (hf, "ProgressCallback"), (builtins, "InfoCallback"),
        (builtins, "DivergenceDetector"), (builtins, "JsonLogger"), (builtins, "TBLogger"),
        (builtins, "GradNormLogger"), (builtins, "ParameterNormLogger"),
        (builtins, "WeightNormLogger"), (builtins, "PeakMemory"), (builtins, "TextgenCallback"),
        (builtins, "ProfilerCallback"), (hf, "DiLoCoCallback"),
        (builtins, "ResumableSummaryWriter"),
    ]:  # fmt: skip
        assert issubclass(getattr(home, name), Callback), name


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_builds_with_defaults_and_has_a_priority_and_a_name(cls, tmp_path):
    callback = build(cls, tmp_path)
    assert isinstance(callback.priority, int)
    assert isinstance(callback.name, str) and callback.name


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_survives_two_training_runs(cls, tmp_path):
    callback = build(cls, tmp_path)
    fit(callback)
    second = fit(callback)
    assert second.state.step == 4


@pytest.mark.parametrize(
    "cls",
    [c for c in CLASSES if callable(getattr(c, "state_dict", None))],
    ids=lambda c: c.__name__,
)
def test_state_round_trips_through_a_real_checkpoint(cls, tmp_path):
    callback = build(cls, tmp_path)
    fit(callback, out_dir=tmp_path / "run")
    saved = torch.load(
        tmp_path / "run" / "checkpoints" / "step-00000004" / "trainer_state.pt", weights_only=True
    )["callbacks"][callback.name]
    fresh = build(cls, tmp_path)
    manager, loaded = CallbackManager(), []
    manager.register(
        "on_checkpoint_load", lambda ctx: loaded.append(fresh.state_dict()), priority=10_000
    )
    resumed = fit(fresh, out_dir=tmp_path / "run", resume="auto", steps=4, manager=manager)
    assert resumed.state.step == 4  # loaded the final checkpoint, nothing left to do
    assert _plain(loaded[0]) == _plain(saved)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_ignores_events_it_has_nothing_to_act_on(cls, tmp_path):
    """Fired with a bare context (no trainer, no metrics), a handler must not raise."""
    callback = build(cls, tmp_path)
    manager = CallbackManager(callback)
    ctx = CallbackContext()
    for event in manager.events:
        if event not in ("on_train_start", "on_exception", "on_data_init_start"):
            manager.fire(event, ctx)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
