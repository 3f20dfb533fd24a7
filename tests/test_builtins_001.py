"""Seed 001's built-ins together: seed names, priorities, and every stateful one
continuing exactly across a real checkpoint resume."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from hookloop import Trainer
from hookloop.callbacks.checkpoint_policy import CheckpointCallback, CheckpointPolicy
from hookloop.callbacks.early_stopping import EarlyStopping, EarlyStoppingCallback
from hookloop.callbacks.grad_monitor import GradientMonitor, GradientMonitorCallback
from hookloop.callbacks.loss_prediction import LossPrediction, LossPredictionCallback
from hookloop.callbacks.nan_detection import NaNDetection, NaNDetectionCallback
from hookloop.callbacks.optimizer_mode import OptimizerMode, OptimizerModeCallback
from hookloop.callbacks.optuna_pruning import OptunaPruning, PrunerCallback
from hookloop.callbacks.overfit import OverfitDetection, OverfitDetectionCallback
from hookloop.manager import CallbackManager
from hookloop.testing import TinyModel, ToyData

optuna = pytest.importorskip("optuna")


def test_seed_names_and_priorities_follow_the_seed():
    seed = {
        NaNDetectionCallback: (NaNDetection, 5),
        OptimizerModeCallback: (OptimizerMode, 10),
        GradientMonitorCallback: (GradientMonitor, 12),
        LossPredictionCallback: (LossPrediction, 70),
        OverfitDetectionCallback: (OverfitDetection, 75),
        PrunerCallback: (OptunaPruning, 85),
        EarlyStoppingCallback: (EarlyStopping, 90),
        CheckpointCallback: (CheckpointPolicy, 95),
    }
    for alias, (native, priority) in seed.items():
        assert alias is native and native.priority == priority


def test_they_run_in_seed_order_within_each_event():
    callbacks = [
        CheckpointPolicy(monitor="eval_loss"),
        EarlyStopping(),
        OptunaPruning(optuna.trial.FixedTrial({})),
        OverfitDetection(),
        LossPrediction(),
        NaNDetection(),
    ]
    manager = CallbackManager(callbacks)
    order = [type(cb).__name__ for cb in manager.list_callbacks("on_eval_end")]
    assert order == [
        "NaNDetection",
        "LossPrediction",
        "OverfitDetection",
        "OptunaPruning",
        "EarlyStopping",
        "CheckpointPolicy",
    ]


STATEFUL = {
    "GradientMonitor": lambda: GradientMonitor(),
    "LossPrediction": lambda: LossPrediction(min_points=2),
    "OverfitDetection": lambda: OverfitDetection(warmup_epochs=0, window_size=1),
    "OptunaPruning": lambda: OptunaPruning(optuna.trial.FixedTrial({}), report_step="eval"),
    "EarlyStopping": lambda: EarlyStopping(patience=100),
    "CheckpointPolicy": lambda: CheckpointPolicy(monitor="eval_loss"),
}


def _run(factory, make_config, out_dir, max_steps, resume=None):
    cb = factory()
    cfg = make_config(max_steps=max_steps, eval_every=3, log_every=2)
    cfg.checkpoint.keep_last = None
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(16),  # 4 steps an epoch
        eval_data=ToyData(4, seed=1),
        config=cfg,
        callbacks=[cb],
        loss_fn=TinyModel.loss_fn,
        out_dir=str(out_dir),
        resume=resume,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return cb


def _portable(state):
    """Checkpoint paths differ between the two runs' directories; compare their names."""
    return {
        k: Path(v).name if isinstance(v, str) and "checkpoints" in v else v
        for k, v in state.items()
    }


@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_after_a_mid_epoch_resume_equals_an_uninterrupted_run(name, make_config, tmp_path):
    factory = STATEFUL[name]
    whole = _run(factory, make_config, tmp_path / "whole", 14)
    _run(factory, make_config, tmp_path / "split", 7)  # mid-epoch 2, between evaluations
    resumed = _run(factory, make_config, tmp_path / "split", 14, resume="auto")
    fresh = factory()
    assert _portable(resumed.state_dict()) == _portable(whole.state_dict())
    assert _portable(resumed.state_dict()) != _portable(fresh.state_dict())  # it held something


def test_events_fired_with_an_empty_context_are_ignored():
    from hookloop import CallbackContext
    from hookloop.events import EVENT_NAMES

    built = [factory() for factory in STATEFUL.values()] + [NaNDetection(), OptimizerMode()]
    for cb in built:
        ctx = CallbackContext()  # no model, optimizer, metrics or logs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "epoch 1 had no logged loss"
            for event in EVENT_NAMES:
                getattr(cb, event)(ctx)
        assert not ctx.control.stop_requested, type(cb).__name__
        assert ctx.user_state == {}, type(cb).__name__
