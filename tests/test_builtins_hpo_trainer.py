"""The HPO trainer's built-ins together: their names, priorities, and every stateful one
continuing exactly across a real checkpoint resume."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import hookloop.compat.hpo as hpo
from _reference_examples import example, with_imports
from hookloop import Callback, Trainer
from hookloop.callbacks.checkpoint_policy import CheckpointPolicy
from hookloop.callbacks.early_stopping import EarlyStopping
from hookloop.callbacks.grad_monitor import GradientMonitor
from hookloop.callbacks.loss_prediction import LossPrediction
from hookloop.callbacks.nan_detection import NaNDetection
from hookloop.callbacks.optimizer_mode import OptimizerMode
from hookloop.callbacks.optuna_pruning import OptunaPruning
from hookloop.callbacks.overfit import OverfitDetection
from hookloop.compat.hpo import (
    CheckpointCallback,
    EarlyStoppingCallback,
    GradientMonitorCallback,
    HpoHooks,
    LossPredictionCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
    OverfitDetectionCallback,
    PrunerCallback,
)
from hookloop.manager import CallbackManager
from hookloop.testing import TinyModel, ToyData

optuna = pytest.importorskip("optuna")


def test_hpo_trainer_names_and_priorities_follow_the_hpo_trainer():
    theirs = {
        NaNDetectionCallback: (NaNDetection, 5),
        OptimizerModeCallback: (OptimizerMode, 10),
        GradientMonitorCallback: (GradientMonitor, 12),
        LossPredictionCallback: (LossPrediction, 70),
        OverfitDetectionCallback: (OverfitDetection, 75),
        PrunerCallback: (OptunaPruning, 85),
        EarlyStoppingCallback: (EarlyStopping, 90),
        CheckpointCallback: (CheckpointPolicy, 95),
    }
    # each is the native built-in, with the HPO trainer's hooks for direct calls besides
    for alias, (native, priority) in theirs.items():
        assert issubclass(alias, native) and issubclass(alias, HpoHooks), alias
        assert alias.priority == native.priority == priority


def test_they_run_in_the_hpo_trainers_order_within_each_event():
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


# -- the HPO trainer's own loop, fired through CallbackRunner -----------------------------------

DOCS_IMPORT = {"from callbacks import": "from hookloop.compat.hpo import TrainingCallback"}


class DocumentedTrainer:
    """A trainer written the way the HPO trainer's docs describe it: seven ``fire`` points, a
    stop check after each epoch, and ``val_loss = inf`` for a NaN run."""

    def __init__(self, model, optimizer, callbacks, *, steps_per_epoch=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(steps_per_epoch * 8, 4, generator=g)
        self.y = self.x @ torch.randn(4, 1, generator=g)
        self.vx = torch.randn(16, 4, generator=g)
        self.vy = self.vx @ torch.randn(4, 1, generator=g)  # another task: val rises
        self.model, self.optimizer, self.callbacks = model, optimizer, callbacks
        self.steps_per_epoch = steps_per_epoch
        self.step_norms: list[list[float]] = []
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []

    def train_epoch(self, epoch):
        self.callbacks.fire("on_train_epoch_begin", self, epoch=epoch)
        self.model.train()
        losses, norms = [], []
        for batch_idx in range(self.steps_per_epoch):
            x, y = (
                self.x[batch_idx * 8 : batch_idx * 8 + 8],
                self.y[batch_idx * 8 : batch_idx * 8 + 8],
            )
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            grads = torch.cat([p.grad.flatten() for p in self.model.parameters()])
            norms.append(float(torch.linalg.vector_norm(grads)))
            self.callbacks.fire(
                "on_train_step_end", self, epoch=epoch, batch_idx=batch_idx, loss=loss.item()
            )
            losses.append(loss.item())
        self.step_norms.append(norms)
        return sum(losses) / len(losses)

    def val_epoch(self, epoch):
        self.callbacks.fire("on_val_begin", self, epoch=epoch)
        self.model.eval()
        with torch.no_grad():
            val_loss = torch.nn.functional.mse_loss(self.model(self.vx), self.vy).item()
        self.val_losses.append(val_loss)
        self.callbacks.fire("on_val_end", self, epoch=epoch, val_loss=val_loss, metrics={})
        return val_loss

    def train(self, epochs):
        self.callbacks.fire("on_train_begin", self)
        val_loss = math.inf
        for epoch in range(epochs):
            train_loss = self.train_epoch(epoch)
            val_loss = self.val_epoch(epoch)
            self.train_losses.append(train_loss)
            lr = self.optimizer.param_groups[0]["lr"]
            self.callbacks.fire(
                "on_epoch_end", self, epoch=epoch, train_loss=train_loss, val_loss=val_loss,
                metrics={}, lr=lr,
            )  # fmt: skip
            if any(getattr(cb, "nan_detected", False) for cb in self.callbacks):
                val_loss = math.inf
                break
            if any(getattr(cb, "should_stop", False) for cb in self.callbacks):
                break
        self.callbacks.fire("on_train_end", self)
        return val_loss


def _documented_runner(epochs, **extra):
    """The docs' callbacks list and runner, cut from the docs' text and run as written."""
    tracker_code = example("hpo_trainer_callbacks", "from callbacks import TrainingCallback", ")")
    namespace: dict = {}
    exec(with_imports(tracker_code, DOCS_IMPORT), namespace)
    code = example(
        "hpo_trainer_callbacks",
        "callbacks_list = [",
        "callback_runner = CallbackRunner(callbacks_list)",
    )
    env = {name: getattr(hpo, name) for name in hpo.__all__}
    env.update(
        BestLossTrackerCallback=namespace["BestLossTrackerCallback"],
        run_config=type("RunConfig", (), {"epochs": epochs}),
        **extra,
    )
    exec(code, env)
    return env["callback_runner"]


@pytest.mark.slow
def test_the_documented_loop_runs_its_callbacks_list_as_written(monkeypatch, tmp_path, capsys):
    from hookloop.callbacks.wandb_logger import offline_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    runner = _documented_runner(12)
    model = torch.nn.Linear(4, 1)
    trainer = DocumentedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), runner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the overfit warning, once the trend shows
        final = trainer.train(12)

    assert final == trainer.val_losses[-1] and len(trainer.val_losses) == 12
    rows = offline_history(tmp_path / "wandb", wait_s=30)
    assert len(rows) == 12  # one row per epoch
    for epoch, row in enumerate(rows):
        assert row["train_loss"] == pytest.approx(trainer.train_losses[epoch], rel=1e-12)
        assert row["val_loss"] == pytest.approx(trainer.val_losses[epoch], rel=1e-12)
        assert row["lr"] == 0.05
        # GradientMonitor: the epoch's largest step norm, computed here independently
        assert row["max_grad_norm"] == pytest.approx(max(trainer.step_norms[epoch]), rel=1e-5)
        # LossPrediction: nothing before epoch 10 (0-based), then the -log10 score
        assert ("predicted_final_loss" in row) == (epoch >= 10), epoch
    assert rows[-1]["predicted_final_loss"] == trainer._loss_prediction
    assert trainer._max_grad_norm == rows[-1]["max_grad_norm"]
    out = capsys.readouterr().out.splitlines()
    # the W&B console summary every 10 epochs, and the docs' tracker's own summary
    assert [line.split(":")[0] for line in out if line.startswith("epoch ")] == [
        "epoch 0",
        "epoch 10",
    ]
    best = min(trainer.val_losses)
    assert out[-1] == (
        f"Training complete. Best val_loss: {best:.4e} at epoch {trainer.val_losses.index(best)}"
    )


def test_a_nan_run_stops_the_documented_loop_and_reports_inf():
    runner = _documented_runner(5, WandbLoggingCallback=lambda: hpo.NaNDetectionCallback())
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    trainer = DocumentedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), runner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert trainer.train(5) == math.inf
    assert len(trainer.val_losses) == 1  # stopped after the first epoch
    nan = next(cb for cb in runner if isinstance(cb, NaNDetection))
    assert nan.nan_detected and "train_loss is nan at epoch 0" in nan.reason


def test_the_hpo_trainers_early_stopping_config_reads_min_delta_as_relative():
    block = example("hpo_trainer_callbacks", "early_stopping_config:", "min_delta: 0.0001")
    config = hpo.EarlyStoppingConfig.from_dict(yaml.safe_load(block)["early_stopping_config"])
    assert (config.enabled, config.patience, config.mode, config.min_delta) == (
        True,
        20,
        "min",
        1e-4,
    )
    theirs = hpo.early_stopping_from_config(config)
    native = EarlyStopping(patience=20, min_delta=1e-4)  # hookloop's: absolute
    # Each value beats the one before by 0.0004 or more (more than 1e-4 absolute), and
    # none beats 100 by 0.01 % (99.99).
    values = [100.0] + [99.999 - 0.0004 * i for i in range(20)]
    runner = hpo.CallbackRunner([theirs, native])
    for epoch, value in enumerate(values):
        runner.fire("on_val_end", None, epoch=epoch, val_loss=value, metrics={})
    assert theirs.should_stop and theirs.stopped_step == 20  # 20 epochs without 0.01 %
    assert not native.should_stop  # each value beat the best by more than 1e-4
    assert hpo.early_stopping_from_config({"enabled": False}) is None
    with pytest.raises(ValueError, match="patience must be an int >= 1"):
        hpo.EarlyStoppingConfig.from_dict({"patience": 0})
    with pytest.raises(ValueError, match=r"unknown keys \['patiense'\]"):
        hpo.EarlyStoppingConfig.from_dict({"patiense": 3})
    with pytest.raises(ValueError, match=r"min_delta must be a fraction in \[0, 1\)"):
        hpo.EarlyStoppingConfig(min_delta=2.0)


def test_hpo_trainer_checkpointing_saves_every_n_epochs_keeps_k_and_the_best(tmp_path):
    from hookloop.checkpoint import STATE_FILE

    checkpoint = hpo.CheckpointCallback(tmp_path / "ckpt", save_every_n_epochs=2, keep_last_k=2)
    early = hpo.EarlyStoppingCallback(patience=100)
    runner = hpo.CallbackRunner([checkpoint, early, hpo.OptimizerModeCallback()])
    model = torch.nn.Linear(4, 1)
    trainer = DocumentedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), runner)
    trainer.train(7)

    best_epoch = trainer.val_losses.index(min(trainer.val_losses)) + 1
    kept = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    # the newest two periodic ones (epochs 4 and 6; 7 is a save only if it is the best)
    expected = {"step-00000004", "step-00000006", f"step-{best_epoch:08d}"}
    if trainer.val_losses[-1] < min(trainer.val_losses[:-1]):
        expected = {"step-00000006", "step-00000007"}
    assert set(kept) == expected
    assert checkpoint.best_step == best_epoch
    state = torch.load(tmp_path / "ckpt" / kept[-1] / STATE_FILE, weights_only=False)
    assert state["callbacks"]["EarlyStopping[eval_loss]"]["trackers"]["eval_loss"]["best"] == min(
        trainer.val_losses[: int(kept[-1][-2:])]
    )
    with pytest.raises(ValueError, match="save_every_n_epochs must be an int >= 1"):
        hpo.CheckpointCallback(tmp_path, save_every_n_epochs=0)
    with pytest.raises(ValueError, match="keep_last_k must be an int >= 1"):
        hpo.CheckpointCallback(tmp_path, keep_last_k=0)
    with pytest.raises(ValueError, match="needs checkpoint_dir"):
        hpo.CallbackRunner([hpo.CheckpointCallback()]).fire("on_train_begin", trainer)


def test_the_hpo_trainers_pruner_reports_each_epochs_val_loss_to_optuna():
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    seen = []

    def objective(trial):
        lr = [0.05, 0.5, 0.01][trial.number]
        runner = hpo.CallbackRunner([hpo.PrunerCallback(trial), hpo.OptimizerModeCallback()])
        model = torch.nn.Linear(4, 1)
        trainer = DocumentedTrainer(model, torch.optim.SGD(model.parameters(), lr=lr), runner)
        seen.append(trainer)
        return trainer.train(4)

    study.optimize(objective, n_trials=3)
    assert [t.state.name for t in study.trials].count("PRUNED") >= 1  # lr 0.5 diverges
    for trial, trainer in zip(study.trials, seen, strict=True):
        reported = trainer.val_losses[: len(trial.intermediate_values)]
        assert trial.intermediate_values == dict(enumerate(reported))
        if trial.state.name == "COMPLETE":
            assert trial.value == trainer.val_losses[-1]
        else:
            assert trial.state.name == "PRUNED"


def _stop_index(values, better):
    """Where patience 2 runs out under the rule ``better(value, best)``; None if never."""
    best, bad = None, 0
    for i, value in enumerate(values):
        if best is None or better(value, best):
            best, bad = value, 0
        else:
            bad += 1
            if bad == 2:
                return i
    return None


def test_the_dialect_early_stopping_is_relative_inside_a_hookloop_trainer_too(make_trainer):
    class Evals(Callback):
        priority = 100

        def __init__(self):
            self.seen = []

        def on_eval_end(self, ctx):
            self.seen.append(ctx.metrics["eval_loss"])

    theirs = hpo.EarlyStoppingCallback(patience=2, min_delta=1e-3)  # 0.1 % better than the best
    evals = Evals()
    trainer = make_trainer([theirs, evals], n=8, eval_n=8, max_epochs=20, eval_every=1)
    result = trainer.train()
    assert theirs.monitor == "eval_loss" and theirs.threshold_mode == "rel"
    relative = _stop_index(evals.seen, lambda v, best: v < best - 1e-3 * abs(best))
    assert relative is not None and len(evals.seen) == relative + 1
    assert "EarlyStopping" in result.stop_reason
    # hookloop's absolute reading of the same min_delta would have gone on
    assert _stop_index(evals.seen, lambda v, best: v < best - 1e-3) != relative
