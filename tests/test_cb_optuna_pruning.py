"""OptunaPruning in real studies stored in SQLite: bad trials are pruned, good ones finish."""

from __future__ import annotations

import math

import pytest
import torch

from hookloop import Trainer, TrainResult
from hookloop.callbacks.nan_detection import NaNDetection
from hookloop.callbacks.optuna_pruning import (
    OptunaPruning,
    is_pruned_stop,
    objective_value,
)
from hookloop.compat.hpo import HpoHooks, PrunerCallback
from hookloop.testing import TinyModel, ToyData

optuna = pytest.importorskip("optuna")
TrialState = optuna.trial.TrialState


@pytest.fixture(autouse=True)
def _quiet_optuna():
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(before)


def _nan_from_step(bad_step):
    def forward_step(state, data, model):
        x, y = next(data)
        out = model(x)
        poison = float("nan") if model.training and state.step >= bad_step else 1.0
        return out, lambda o: (torch.nn.functional.mse_loss(o, y) * poison, {})

    return forward_step


def _objective(make_config, forward_step=None, **pruning_kwargs):
    def objective(trial):
        cfg = make_config(max_steps=8, eval_every=2)
        cfg.optimizer.lr = trial.suggest_float("lr", 1e-3, 1e3, log=True)
        trainer = Trainer(
            TinyModel(),
            train_data=ToyData(32),
            eval_data=ToyData(8, seed=1),
            config=cfg,
            callbacks=[NaNDetection(), OptunaPruning(trial, **pruning_kwargs)],
            loss_fn=None if forward_step else TinyModel.loss_fn,
            forward_step=forward_step,
        )
        return objective_value(trainer.train())

    return objective


def _study(tmp_path, name="hpo"):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        direction="minimize",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0),
    )
    return study, storage


@pytest.mark.parametrize("raise_pruned", [True, False], ids=["raise", "stop-then-objective"])
def test_a_diverging_trial_is_pruned_and_a_good_one_completes(make_config, tmp_path, raise_pruned):
    study, storage = _study(tmp_path)
    for lr in (0.03, 500.0):  # a good learning rate, then one that blows the model up
        study.enqueue_trial({"lr": lr})
    study.optimize(_objective(make_config, raise_pruned=raise_pruned), n_trials=2)

    stored = optuna.load_study(study_name="hpo", storage=storage).trials
    assert [t.state for t in stored] == [TrialState.COMPLETE, TrialState.PRUNED]
    good, bad = stored
    assert sorted(good.intermediate_values) == [2, 4, 6, 8]  # reported at each evaluation's step
    assert good.value == pytest.approx(good.intermediate_values[8])
    assert sorted(bad.intermediate_values) == [2]  # pruned at its first evaluation
    assert bad.intermediate_values[2] > good.intermediate_values[2]


def test_a_good_second_trial_is_not_pruned(make_config, tmp_path):
    study, storage = _study(tmp_path)
    for lr in (0.003, 0.03):  # the second learns faster: better at every evaluation
        study.enqueue_trial({"lr": lr})
    study.optimize(_objective(make_config), n_trials=2)
    states = [t.state for t in optuna.load_study(study_name="hpo", storage=storage).trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE]


def test_what_the_user_sees_when_a_trial_is_pruned(make_config, tmp_path):
    study, _ = _study(tmp_path)
    study.enqueue_trial({"lr": 0.03})
    study.optimize(_objective(make_config), n_trials=1)
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(1e-3, 1e3, log=True)})
    cfg = make_config(max_steps=8, eval_every=2)
    cfg.optimizer.lr = 500.0
    pruning = OptunaPruning(trial)
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(32),
        eval_data=ToyData(8, seed=1),
        config=cfg,
        callbacks=[pruning],
        loss_fn=TinyModel.loss_fn,
    )
    with pytest.raises(optuna.TrialPruned, match="trial 1 pruned at step 2") as err:
        trainer.train()
    assert any("'OptunaPruning'" in n and "on_eval_end" in n for n in err.value.__notes__)
    assert pruning.pruned and trainer.state.step == 2


def test_report_step_eval_counts_evaluations(make_config, tmp_path):
    study, storage = _study(tmp_path)
    study.optimize(_objective(make_config, report_step="eval"), n_trials=1)
    (trial,) = optuna.load_study(study_name="hpo", storage=storage).trials
    assert sorted(trial.intermediate_values) == [0, 1, 2, 3]


def test_a_direct_evaluate_after_training_is_not_reported(make_config, tmp_path):
    study, _ = _study(tmp_path)
    trial = study.ask()
    cfg = make_config(max_steps=4, eval_every=2)
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(32),
        eval_data=ToyData(8, seed=1),
        config=cfg,
        callbacks=[OptunaPruning(trial)],
        loss_fn=TinyModel.loss_fn,
    )
    trainer.train()
    trainer.evaluate()
    assert sorted(study.trials[0].intermediate_values) == [2, 4]


# -- the objective's value, as the HPO trainer returns it ------------------------------------


def _result(stop_reason="max_steps", **metrics):
    return TrainResult(step=8, epoch=0, stop_reason=stop_reason, metrics=metrics)


def test_objective_value_is_the_final_metric_for_a_finished_run():
    assert objective_value(_result(eval_loss=0.25)) == 0.25
    assert objective_value(_result(eval_acc=0.9), "eval_acc", "maximize") == 0.9


def test_a_failed_run_returns_inf_like_the_hpo_trainer():
    nan_stop = "NaNDetection: non-finite loss (nan) at step 3 (the step's update was skipped)"
    assert objective_value(_result(nan_stop, eval_loss=0.5)) == math.inf  # last eval was fine
    assert objective_value(_result(f"abort: {nan_stop}", eval_loss=0.5)) == math.inf
    assert objective_value(_result(eval_loss=math.nan)) == math.inf
    assert objective_value(_result()) == math.inf  # never evaluated
    assert objective_value(_result(eval_acc=math.nan), "eval_acc", "maximize") == -math.inf


def test_a_pruned_run_makes_the_objective_raise_trial_pruned():
    reason = "OptunaPruning: trial 3 pruned at step 4 (eval_loss=9.1)"
    assert is_pruned_stop(reason)
    with pytest.raises(optuna.TrialPruned, match="trial 3"):
        objective_value(_result(reason, eval_loss=9.1))


def test_a_nan_trial_completes_with_value_inf_in_the_study(make_config, tmp_path):
    study, storage = _study(tmp_path)
    study.enqueue_trial({"lr": 0.03})
    study.optimize(_objective(make_config, forward_step=_nan_from_step(3)), n_trials=1)
    (trial,) = optuna.load_study(study_name="hpo", storage=storage).trials
    assert trial.state == TrialState.COMPLETE and trial.value == math.inf
    assert sorted(trial.intermediate_values) == [2]  # evaluated once, stopped at step 3


def test_hpo_trainer_name_priority_and_validation(tmp_path):
    # the HPO trainer's name: the native class, taking the HPO trainer's direct hook calls too
    assert PrunerCallback.__mro__[1:3] == (HpoHooks, OptunaPruning)
    assert OptunaPruning.priority == 85
    trial = optuna.trial.FixedTrial({})
    with pytest.raises(ValueError, match="trial"):
        OptunaPruning(object())
    with pytest.raises(ValueError, match="report_step"):
        OptunaPruning(trial, report_step="epoch")
    with pytest.raises(ValueError, match="raise_pruned"):
        OptunaPruning(trial, raise_pruned="yes")
    with pytest.raises(ValueError, match="monitor"):
        OptunaPruning(trial, monitor="")
    with pytest.raises(ValueError, match="direction"):
        objective_value(_result(eval_loss=1.0), direction="min")
