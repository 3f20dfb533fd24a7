"""Code written for the HPO trainer, run against hookloop.compat.hpo with only the import changed.

The HPO trainer's users build its built-ins with its constructors
(``PrunerCallback(pruner, trial, seed)``, ``CheckpointCallback(manager, config_hash)``),
call their hooks themselves with its arguments, make an empty ``CallbackRunner()``,
and drive an Optuna study through a multi-seed ``run()`` function that turns any
error into a pruned trial. Each test does one of those things and checks what
the user sees: the flags on the callback, the ``trainer._<name>`` results, what
reached their pruner and checkpoint manager, and the trial states of a study.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hookloop.compat.hpo as hpo
from hookloop import Trainer
from hookloop.testing import TinyModel, ToyData

optuna = pytest.importorskip("optuna")


class RecordingPruner:
    """A pruner of the HPO trainer's kind: told each value by keyword, asked after each."""

    def __init__(self, prune: bool = False) -> None:
        self.reports: list[dict] = []
        self.prune = prune

    def report(self, *, trial_id, seed, epoch, value) -> None:
        self.reports.append({"trial_id": trial_id, "seed": seed, "epoch": epoch, "value": value})

    def should_prune(self) -> bool:
        return self.prune


class RecordingManager:
    """A checkpoint manager of the HPO trainer's kind: records each ``maybe_save`` call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def maybe_save(self, *args) -> None:
        self.calls.append(args)


def _trial(number_of_earlier: int = 0):
    study = optuna.create_study()
    for _ in range(number_of_earlier):
        study.tell(study.ask(), 1.0)
    return study.ask()


def _loop_trainer(**attributes) -> SimpleNamespace:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, **attributes)


# -- the HPO trainer's constructor forms -------------------------------------------------


@pytest.mark.parametrize("by_keyword", [False, True])
def test_pruner_callback_with_pruner_trial_and_seed_reports_to_the_pruner(by_keyword):
    trial, pruner = _trial(number_of_earlier=2), RecordingPruner()
    if by_keyword:
        callback = hpo.PrunerCallback(pruner=pruner, trial=trial, seed=7)
    else:
        callback = hpo.PrunerCallback(pruner, trial, 7)
    callback.on_val_end(trainer=_loop_trainer(), epoch=0, val_loss=0.25, metrics={})
    callback.on_val_end(_loop_trainer(), 1, 0.125, {})  # positional, as the hook is declared
    assert pruner.reports == [
        {"trial_id": 2, "seed": 7, "epoch": 0, "value": 0.25},
        {"trial_id": 2, "seed": 7, "epoch": 1, "value": 0.125},
    ]
    assert not callback.pruned and trial.study.trials[trial.number].intermediate_values == {}


def test_pruner_callback_raises_trial_pruned_when_its_pruner_says_so():
    callback = hpo.PrunerCallback(RecordingPruner(prune=True), _trial(), 3)
    with pytest.raises(optuna.TrialPruned, match="pruned by RecordingPruner at epoch 4"):
        callback.on_val_end(trainer=_loop_trainer(), epoch=4, val_loss=9.0, metrics={})
    assert callback.pruned


def test_pruner_callback_without_a_pruner_reports_nothing():
    callback = hpo.PrunerCallback(None, _trial(), 0)
    callback.on_val_end(trainer=_loop_trainer(), epoch=0, val_loss=1.0, metrics={})
    assert not callback.pruned


def test_pruner_callback_given_two_of_the_three_names_the_missing_one():
    with pytest.raises(TypeError, match=r"PrunerCallback\(pruner, trial, seed\) is missing seed"):
        hpo.PrunerCallback(RecordingPruner(), _trial())
    with pytest.raises(ValueError, match="should_prune"):
        hpo.PrunerCallback(object(), _trial(), 0)


def test_pruner_callback_with_an_optuna_trial_alone_still_reports_to_the_trial():
    trial = _trial()
    callback = hpo.PrunerCallback(trial)
    callback.on_val_end(trainer=_loop_trainer(), epoch=3, val_loss=0.5, metrics={})
    assert callback.pruner is None and trial.storage.get_trial(
        trial._trial_id
    ).intermediate_values == {3: 0.5}


@pytest.mark.parametrize("by_keyword", [False, True])
def test_checkpoint_callback_with_a_manager_hands_each_epoch_to_it(by_keyword):
    manager = RecordingManager()
    if by_keyword:
        checkpoint = hpo.CheckpointCallback(checkpoint_manager=manager, config_hash="abc123")
    else:
        checkpoint = hpo.CheckpointCallback(manager, "abc123")
    stopper = hpo.EarlyStoppingCallback(patience=3)
    trainer = _loop_trainer(callbacks=hpo.CallbackRunner([checkpoint, stopper]))
    stopper.on_val_end(trainer=trainer, epoch=0, val_loss=0.5, metrics={})
    checkpoint.on_epoch_end(
        trainer=trainer, epoch=0, train_loss=0.6, val_loss=0.5, metrics={"acc": 1.0}
    )
    [(epoch, model, optimizer, scheduler, val_loss, metrics, stopping, config_hash)] = manager.calls
    assert (epoch, val_loss, metrics, config_hash) == (0, 0.5, {"acc": 1.0}, "abc123")
    assert (model, optimizer, scheduler) == (trainer.model, trainer.optimizer, trainer.scheduler)
    assert {k: stopping[k] for k in ("counter", "best_value", "should_stop")} == {
        "counter": 0,
        "best_value": 0.5,
        "should_stop": False,
    }


def test_checkpoint_callback_with_a_manager_refuses_settings_that_belong_to_the_manager():
    with pytest.raises(ValueError, match="pass checkpoint_dir and keep_last_k to it"):
        hpo.CheckpointCallback(RecordingManager(), keep_last_k=2)
    with pytest.raises(ValueError, match="maybe_save"):
        hpo.CheckpointCallback(checkpoint_manager=object())


def test_an_empty_callback_runner_fires_every_event_and_takes_callbacks_later():
    runner = hpo.CallbackRunner()
    assert len(runner) == 0 and not runner.should_stop
    trainer = _loop_trainer()
    for event in hpo.EVENTS:
        runner.fire(event, trainer=trainer, epoch=0, val_loss=0.1, train_loss=0.1, metrics={})
    nan = hpo.NaNDetectionCallback()
    runner.add(nan)
    runner.fire("on_epoch_end", trainer=trainer, epoch=1, train_loss=math.nan, val_loss=0.1)
    assert nan.nan_detected and runner.should_stop


# -- each built-in's hooks, called directly ----------------------------------------------


def _every_builtin(tmp_path) -> list:
    return [
        hpo.NaNDetectionCallback(),
        hpo.OptimizerModeCallback(),
        hpo.GradientMonitorCallback(),
        hpo.LossPredictionCallback(20),
        hpo.OverfitDetectionCallback(),
        hpo.WandbLoggingCallback(mode="disabled", dir=tmp_path),
        hpo.PrunerCallback(RecordingPruner(), _trial(), 0),
        hpo.EarlyStoppingCallback(),
        hpo.CheckpointCallback(tmp_path / "checkpoints"),
    ]


def test_every_builtin_takes_all_seven_hooks_by_keyword_and_by_position(tmp_path):
    trainer = _loop_trainer(_total_epochs=2)
    for callback in _every_builtin(tmp_path):
        for epoch in range(2):
            callback.on_train_begin(trainer=trainer)
            callback.on_train_epoch_begin(trainer=trainer, epoch=epoch)
            callback.on_train_step_end(trainer=trainer, batch_idx=0, loss=0.5)
            callback.on_val_begin(trainer, epoch)
            callback.on_val_end(trainer, epoch, 0.4, {})
            callback.on_epoch_end(trainer, epoch, 0.5, 0.4, {})
            callback.on_train_end(trainer=trainer)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert saved == ["step-00000001", "step-00000002"]  # one save per epoch


def test_nan_detection_called_directly_flags_a_nan_loss_only():
    nan = hpo.NaNDetectionCallback()
    nan.on_epoch_end(trainer=_loop_trainer(), epoch=0, train_loss=0.5, val_loss=0.4, metrics={})
    assert not nan.nan_detected
    nan.on_epoch_end(
        trainer=_loop_trainer(), epoch=1, train_loss=0.5, val_loss=math.nan, metrics={}
    )
    assert nan.nan_detected


def test_optimizer_mode_called_directly_switches_an_optimizer_that_has_modes():
    switched = []
    trainer = _loop_trainer()
    trainer.optimizer.train = lambda: switched.append("train")
    trainer.optimizer.eval = lambda: switched.append("eval")
    mode = hpo.OptimizerModeCallback()
    mode.on_train_epoch_begin(trainer=trainer, epoch=0)
    mode.on_val_begin(trainer=trainer, epoch=0)
    assert switched == ["train", "eval"]


def _set_grads(model: torch.nn.Module, *values: float) -> None:
    for param, value in zip(model.parameters(), values, strict=True):
        param.grad = torch.full_like(param, value)


def test_gradient_monitor_called_directly_keeps_the_epoch_maximum_in_float64():
    trainer = _loop_trainer()
    trainer.model = torch.nn.Sequential(
        torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    )
    monitor = hpo.GradientMonitorCallback(warn_threshold=math.inf)
    big = 2.0**64  # 3*big and 4*big are exact in float32, their squares are past its range

    monitor.on_train_epoch_begin(trainer=trainer, epoch=0)
    for grads in [(3.0, 4.0), (3 * big, 4 * big), (1.0, 1.0)]:
        _set_grads(trainer.model, *grads)
        monitor.on_train_step_end(trainer=trainer, batch_idx=0, loss=1.0)
    monitor.on_epoch_end(trainer=trainer, epoch=0, train_loss=1.0, val_loss=1.0, metrics={})
    assert trainer._max_grad_norm == 5 * big and math.isfinite(trainer._max_grad_norm)

    monitor.on_train_epoch_begin(trainer=trainer, epoch=1)
    _set_grads(trainer.model, math.inf, 1.0)
    monitor.on_train_step_end(trainer=trainer, batch_idx=0, loss=1.0)
    monitor.on_epoch_end(trainer=trainer, epoch=1, train_loss=1.0, val_loss=1.0, metrics={})
    assert trainer._max_grad_norm == math.inf  # a diverged step reads inf, never nan
    assert monitor.epoch_maxima == [5 * big, math.inf]


def test_loss_prediction_called_directly_predicts_from_epoch_ten():
    prediction = hpo.LossPredictionCallback(max_epochs=30)
    trainer = _loop_trainer(_loss_prediction="unset")
    losses = [0.8 * math.exp(-0.1 * epoch) for epoch in range(12)]
    for epoch, loss in enumerate(losses):
        prediction.on_val_end(trainer=trainer, epoch=epoch, val_loss=loss, metrics={})
        if epoch == 9:
            assert trainer._loss_prediction is None
    # log(loss) is the line log(0.8) - 0.1 t; read at t = 30 and shown as -log10
    slope, intercept = np.polyfit(np.arange(12), np.log(losses), 1)
    assert trainer._loss_prediction == pytest.approx(-(intercept + 30 * slope) / math.log(10))
    assert trainer._loss_prediction == pytest.approx(-math.log10(0.8 * math.exp(-3.0)))


def test_overfit_detection_called_directly_reports_the_gap_when_the_losses_part():
    overfit = hpo.OverfitDetectionCallback(warmup_epochs=2, window_size=3)
    trainer = _loop_trainer()
    train = [1.0, 0.9, 0.8, 0.7, 0.6]
    val = [1.0, 0.95, 1.0, 1.1, 1.2]
    with pytest.warns(Warning, match="gap ratio"):
        for epoch, (t, v) in enumerate(zip(train, val, strict=True)):
            overfit.on_epoch_end(trainer=trainer, epoch=epoch, train_loss=t, val_loss=v, metrics={})
            if epoch == 2:
                assert trainer._overfit_gap_ratio is None  # val fell from epoch 0 to 1
    assert trainer._overfit_gap_ratio == pytest.approx(1.2 / 0.6)


def test_early_stopping_called_directly_counts_stops_and_round_trips_its_state():
    stopper = hpo.EarlyStoppingCallback(patience=2, mode="min", min_delta=0.01)
    trainer = _loop_trainer()
    for epoch, loss in enumerate([1.0, 0.995, 0.8]):  # 0.995 is within 1 % of 1.0
        stopper.on_val_end(trainer=trainer, epoch=epoch, val_loss=loss, metrics={})
        assert (stopper.counter, stopper.should_stop) == ([0, 1, 0][epoch], False)
    assert stopper.best_value == 0.8
    for epoch in (3, 4):
        stopper.on_val_end(trainer=trainer, epoch=epoch, val_loss=0.9, metrics={})
    assert (stopper.counter, stopper.should_stop) == (2, True)

    again = hpo.EarlyStoppingCallback(patience=2, mode="min", min_delta=0.01)
    again.load_state_dict(stopper.state_dict())
    assert (again.counter, again.best_value, again.should_stop) == (2, 0.8, True)


# -- inside a hookloop Trainer -----------------------------------------------------------


def test_the_hpo_trainers_pruner_and_manager_forms_also_run_inside_a_hookloop_trainer(
    make_config,
):
    pruner, manager = RecordingPruner(), RecordingManager()
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(16),
        eval_data=ToyData(8, seed=1),
        config=make_config(max_epochs=3),
        callbacks=[
            hpo.PrunerCallback(pruner, _trial(number_of_earlier=1), 11),
            hpo.CheckpointCallback(manager, "cfg"),
            hpo.EarlyStoppingCallback(patience=50),
        ],
        loss_fn=TinyModel.loss_fn,
    )
    result = trainer.train()
    assert [(r["trial_id"], r["seed"], r["epoch"]) for r in pruner.reports] == [
        (1, 11, 0),
        (1, 11, 1),
        (1, 11, 2),
    ]
    assert [r["value"] for r in pruner.reports][-1] == pytest.approx(result.metrics["eval_loss"])
    assert [call[0] for call in manager.calls] == [0, 1, 2]
    assert [call[4] for call in manager.calls] == [r["value"] for r in pruner.reports]
    assert all(call[7] == "cfg" and "counter" in call[6] for call in manager.calls)


# -- an Optuna study through a driver shaped like the HPO trainer's run() ----------------


class FinishedTrialsPruner:
    """A pruner of the HPO trainer's kind (register, report per seed, complete): once
    ``startup`` trials have finished, it prunes a trial whose value at an epoch is more
    than ``factor`` times the best value a finished trial had at that epoch."""

    def __init__(self, startup: int = 2, factor: float = 8.0) -> None:
        self.startup, self.factor = startup, factor
        self.running: dict[int, dict[int, float]] = {}  # trial -> epoch -> latest value
        self.best_at: dict[int, float] = {}  # epoch -> best value of a finished trial
        self.finished = 0
        self.last: tuple[int, int] | None = None

    def register_trial(self, trial_id: int) -> None:
        self.running[trial_id] = {}

    def report(self, *, trial_id, seed, epoch, value) -> None:
        self.running.setdefault(trial_id, {})[epoch] = value
        self.last = (trial_id, epoch)

    def should_prune(self) -> bool:
        if self.finished < self.startup or self.last is None:
            return False
        trial_id, epoch = self.last
        return self.running[trial_id][epoch] > self.factor * self.best_at[epoch]

    def complete_trial(self, trial_id: int) -> None:
        self.finished += 1
        for epoch, value in self.running.pop(trial_id, {}).items():
            self.best_at[epoch] = min(value, self.best_at.get(epoch, math.inf))


def _line_data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1, 1, 32).unsqueeze(1)
    return x, 2 * x + 1


def _train_one_seed(runner, trainer, epochs: int) -> float:
    """The HPO trainer's epoch loop, in short: four steps, one validation, stop flags."""
    x, y = _line_data()
    fire, val_loss = runner.fire, math.inf
    fire("on_train_begin", trainer=trainer, epochs=epochs)
    for epoch in range(epochs):
        fire("on_train_epoch_begin", trainer=trainer, epoch=epoch)
        total = 0.0
        for batch_idx in range(4):
            xb, yb = x[batch_idx::4], y[batch_idx::4]
            loss = torch.nn.functional.mse_loss(trainer.model(xb), yb)
            trainer.optimizer.zero_grad()
            loss.backward()
            trainer.optimizer.step()
            total += loss.item() / 4
            fire("on_train_step_end", trainer=trainer, batch_idx=batch_idx, loss=loss.item())
        fire("on_val_begin", trainer=trainer, epoch=epoch)
        with torch.no_grad():
            val_loss = torch.nn.functional.mse_loss(trainer.model(x), y).item()
        fire("on_val_end", trainer=trainer, epoch=epoch, val_loss=val_loss, metrics={})
        fire(
            "on_epoch_end", trainer=trainer, epoch=epoch, train_loss=total, val_loss=val_loss,
            metrics={},
        )  # fmt: skip
        if runner.should_stop:
            break
        trainer.scheduler.step()
    fire("on_train_end", trainer=trainer)
    return val_loss


def _run_trial(trial, pruner, lr: float, errors: list, manager, seeds=(1, 2), epochs=6) -> float:
    """What the HPO trainer's run() does for a trial: every seed with the same built-ins; any
    error becomes a pruned trial (so a refused constructor would prune every trial)."""
    pruner.register_trial(trial.number)
    finals = []
    try:
        for seed in seeds:
            torch.manual_seed(seed)
            model = torch.nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            runner = hpo.CallbackRunner(
                [
                    hpo.OptimizerModeCallback(),
                    hpo.NaNDetectionCallback(),
                    hpo.GradientMonitorCallback(),
                    hpo.LossPredictionCallback(epochs),
                    hpo.OverfitDetectionCallback(),
                    hpo.WandbLoggingCallback(mode="disabled"),
                    hpo.EarlyStoppingCallback(patience=3, mode="min", min_delta=1e-4),
                    hpo.PrunerCallback(pruner, trial, seed),
                    hpo.CheckpointCallback(manager, f"trial-{trial.number}"),
                ]
            )
            trainer = SimpleNamespace(
                model=model, optimizer=optimizer, scheduler=scheduler, callbacks=runner,
                _total_epochs=epochs,
            )  # fmt: skip
            finals.append(_train_one_seed(runner, trainer, epochs))
    except optuna.TrialPruned:
        raise
    except Exception as exc:
        errors.append(exc)
        raise optuna.TrialPruned() from exc
    finally:
        pruner.complete_trial(trial.number)
    return sum(finals) / len(finals)


def test_a_small_study_through_a_run_shaped_driver_completes_and_prunes_by_the_pruner(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner, manager, errors = FinishedTrialsPruner(), RecordingManager(), []
    study = optuna.create_study(direction="minimize")
    learning_rates = [0.2, 0.1, 1e-4, 0.15, 1e-5]
    for lr in learning_rates:
        study.enqueue_trial({"lr": lr})

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-6, 1.0, log=True)
        return _run_trial(trial, pruner, lr, errors, manager)

    study.optimize(objective, n_trials=len(learning_rates))

    assert errors == []
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE", "PRUNED"]
    assert all(t.value < 0.5 for t in study.trials if t.state.name == "COMPLETE")
    # the checkpoint manager saw every epoch of every seed of the completed trials
    per_trial = {}
    for call in manager.calls:
        per_trial.setdefault(call[7], []).append(call[0])
    assert per_trial["trial-0"] == [0, 1, 2, 3, 4, 5] * 2
