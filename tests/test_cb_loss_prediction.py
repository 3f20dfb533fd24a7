"""LossPrediction: exponential fit with numbers, then on a scripted run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hookloop import Callback, Trainer
from hookloop.callbacks.loss_prediction import (
    LossPrediction,
    fit_exponential,
    predict_loss,
    prediction_score,
)
from hookloop.compat.hpo import HpoHooks, LossPredictionCallback
from hookloop.testing import TinyModel, ToyData

# -- the pure fit ------------------------------------------------------------------------


def test_an_exact_exponential_is_recovered():
    t = np.arange(0, 50, 5.0)
    a, k = fit_exponential(t, 3.0 * np.exp(-0.04 * t))
    assert (a, k) == (pytest.approx(3.0), pytest.approx(-0.04))
    assert predict_loss(t, 3.0 * np.exp(-0.04 * t), 200) == pytest.approx(3.0 * math.exp(-8))


def test_noisy_data_is_fitted_in_log_space_by_least_squares():
    rng = np.random.default_rng(0)
    t = np.arange(1, 41, dtype=float)
    losses = 2.0 * np.exp(-0.05 * t) * np.exp(rng.normal(0, 0.05, t.size))
    k_ls, log_a_ls = np.polyfit(t, np.log(losses), 1)
    a, k = fit_exponential(t, losses)
    assert k == pytest.approx(k_ls) and a == pytest.approx(math.exp(log_a_ls))


def test_large_step_numbers_do_not_overflow_the_fit():
    t = 1e6 + np.arange(10) * 100.0
    losses = np.exp(-1e-3 * (t - 1e6))
    assert predict_loss(t, losses, 1e6 + 2000) == pytest.approx(math.exp(-2))


@pytest.mark.parametrize(
    ("times", "losses"),
    [([1], [0.5]), ([1, 1], [0.5, 0.4]), ([1, 2], [0.5, 0.0]), ([1, 2], [0.5, math.nan])],
    ids=["one-point", "same-time", "zero-loss", "nan-loss"],
)
def test_impossible_fits_return_none(times, losses):
    assert fit_exponential(times, losses) is None


def test_score_is_minus_log10_of_the_prediction():
    t = [10, 20, 30]
    losses = [0.1 * math.exp(-0.01 * s) for s in t]
    expected = -math.log10(0.1 * math.exp(-0.01 * 100))
    assert prediction_score(t, losses, horizon=100) == pytest.approx(expected)


def test_score_falls_back_to_the_latest_loss_when_the_fit_fails_or_blows_up():
    assert prediction_score([1, 2], [0.5, 0.0], 10) is None  # no fit, and log10(0) is not finite
    assert prediction_score([1, 2, 3], [0.0, 0.2, 0.1], 10) == pytest.approx(1.0)  # no fit
    rising = [1.0, 10.0, 100.0]  # x10 a step: 10**1000 at the horizon overflows to inf
    assert prediction_score([1, 2, 3], rising, 1000) == pytest.approx(-2.0)
    falling = [1.0, 1e-10, 1e-20]  # underflows to 0.0
    assert prediction_score([1, 2, 3], falling, 1000) == pytest.approx(20.0)
    assert prediction_score([1, 2], [0.5, 0.01], None) == pytest.approx(2.0)  # no horizon
    assert prediction_score([1, 2], [0.5, math.nan], 10) is None


# -- the callback on a scripted run ------------------------------------------------------


def _curve(step: float) -> float:
    return 2.0 * math.exp(-0.05 * step)


class _ScriptedEval(Callback):
    """Replaces eval_loss by the curve's value at the current step; records logs."""

    priority = 0

    def __init__(self) -> None:
        self.logged: list[tuple[int, float | None]] = []

    def on_eval_end(self, ctx):
        ctx.metrics["eval_loss"] = _curve(ctx.state.step)

    def on_log(self, ctx):
        self.logged.append((ctx.state.step, ctx.logs.get("predicted_final_loss")))


def test_after_min_points_evaluations_the_prediction_is_logged_at_each_log(make_trainer):
    script, pred = _ScriptedEval(), LossPrediction(min_points=10)
    trainer = make_trainer([script, pred], n=16, eval_n=4, max_steps=40, eval_every=2, log_every=2)
    trainer.train()

    expected = -math.log10(_curve(40))  # the run's last step
    # The 10th evaluation is at step 20; the log of a step comes before its evaluation.
    assert all(v is None for s, v in script.logged if s <= 20)
    assert all(v == pytest.approx(expected) for s, v in script.logged if s > 20)
    assert len(pred.losses) == 20
    assert pred.predicted_loss == pytest.approx(_curve(40))
    assert trainer.callbacks.user_state["predicted_final_loss"] == pytest.approx(expected)


def test_hpo_trainer_style_max_epochs_extrapolates_to_the_last_epoch(make_trainer):
    pred = LossPredictionCallback(6, min_points=3)  # LossPredictionCallback(max_epochs)
    trainer = make_trainer([_ScriptedEval(), pred], n=16, eval_n=4, max_epochs=3)
    trainer.train()  # 4 steps an epoch, evaluated at each epoch end: steps 4, 8, 12
    assert pred.times == [4.0, 8.0, 12.0]
    assert pred.predicted_loss == pytest.approx(_curve(24))  # epoch 6 ends at step 24


def test_horizon_steps_sets_the_target_and_fewer_points_predict_nothing(make_trainer):
    pred = LossPrediction(min_points=5, horizon_steps=1000)
    trainer = make_trainer([_ScriptedEval(), pred], n=16, eval_n=4, max_steps=8, eval_every=2)
    trainer.train()
    assert pred.prediction is None  # only 4 evaluations
    trainer.progress.max_steps = 10
    trainer.train()
    assert pred.predicted_loss == pytest.approx(_curve(1000))


def test_a_direct_evaluate_outside_training_is_not_a_point(make_trainer):
    pred = LossPrediction(min_points=2)
    trainer = make_trainer([pred], n=16, eval_n=4, max_steps=2, eval_every=1)
    trainer.evaluate()
    trainer.train()
    trainer.evaluate()
    assert pred.times == [1.0, 2.0]


def test_a_missing_monitor_warns_once_and_predicts_nothing(make_trainer):
    pred = LossPrediction(monitor="eval_perplexity", min_points=2)
    trainer = make_trainer([pred], n=16, eval_n=4, max_steps=4, eval_every=1)
    with pytest.warns(UserWarning, match="eval_perplexity") as got:
        trainer.train()
    assert len([w for w in got if "eval_perplexity" in str(w.message)]) == 1
    assert pred.prediction is None


def test_hpo_trainer_name_priority_and_validation():
    # the HPO trainer's name: the native class, taking the HPO trainer's direct hook calls too
    assert LossPredictionCallback.__mro__[1:3] == (HpoHooks, LossPrediction)
    assert LossPrediction.priority == 70
    for kwargs, named in [
        ({"min_points": 1}, "min_points"),
        ({"max_epochs": 0}, "max_epochs"),
        ({"horizon_steps": 2.5}, "horizon_steps"),
        ({"max_epochs": 3, "horizon_steps": 30}, "not both"),
        ({"monitor": ""}, "monitor"),
    ]:
        with pytest.raises(ValueError, match=named):
            LossPrediction(**kwargs)


class _Unsized:
    """Batches without a length: the run has no step budget to extrapolate to."""

    def __iter__(self):
        data = ToyData(16)
        for i in range(0, 16, 4):
            yield data.x[i : i + 4], data.y[i : i + 4]


def test_without_a_step_budget_it_reports_the_latest_loss_and_says_why(make_config):
    pred = LossPrediction(min_points=2)
    trainer = Trainer(
        TinyModel(),
        train_data=_Unsized(),
        eval_data=ToyData(4, seed=1),
        config=make_config(max_epochs=1, eval_every=2),
        callbacks=[_ScriptedEval(), pred],
        loss_fn=TinyModel.loss_fn,
    )
    assert trainer.state.max_steps is None
    with pytest.warns(UserWarning, match="horizon_steps"):
        trainer.train()
    assert pred.predicted_loss is None
    assert pred.prediction == pytest.approx(-math.log10(_curve(4)))
