"""OverfitDetection: the divergence rule with numbers, then on scripted epochs."""

from __future__ import annotations

import math
import warnings

import pytest

from hookloop import Callback
from hookloop.callbacks.overfit import (
    OverfitDetection,
    OverfitWarning,
    gap_ratio,
    is_diverging,
)
from hookloop.compat.hpo import HpoHooks, OverfitDetectionCallback

# -- the rule -------------------------------------------------------------------------------


def test_window_one_fires_on_a_single_epoch_of_divergence():
    assert is_diverging([2.0, 1.0], [1.0, 1.1], window=1)
    assert not is_diverging([2.0, 1.0], [1.0, 0.9], window=1)


def test_the_whole_window_must_diverge_strictly():
    train = [5, 4, 3, 2, 1]
    assert is_diverging(train, [1, 0.5, 0.6, 0.7, 0.8], window=3)
    assert not is_diverging(train, [1, 0.5, 0.6, 0.7, 0.8], window=4)  # 1 -> 0.5 fell
    assert not is_diverging(train, [1, 2, 3, 3, 4], window=3)  # a flat step
    assert not is_diverging([5, 4, 4, 3, 2], [1, 2, 3, 4, 5], window=3)  # train flat


def test_too_few_epochs_or_nan_never_diverge():
    assert not is_diverging([2, 1], [1, 2], window=2)
    assert not is_diverging([3, 2, 1], [1, math.nan, 3], window=2)


def test_gap_ratio_is_eval_over_train():
    assert gap_ratio(0.5, 1.0) == 2.0
    assert gap_ratio(0.0, 1.0) == math.inf


# -- on scripted epochs -----------------------------------------------------------------------

TRAIN = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]  # per epoch: always falling
EVAL = [1.0, 0.9, 0.8, 0.7, 0.8, 0.9, 1.0]  # falls, then rises from epoch 5 on


class _ScriptedEpochs(Callback):
    """Sets the logged train loss and the evaluation loss from the lists, per epoch."""

    priority = 0

    def __init__(self) -> None:
        self.logged: list[tuple[int, float | None]] = []

    def on_before_log(self, ctx):
        ctx.logs["loss"] = TRAIN[ctx.state.epoch]

    def on_eval_end(self, ctx):
        ctx.metrics["eval_loss"] = EVAL[ctx.state.epoch]

    def on_log(self, ctx):
        self.logged.append((ctx.state.epoch, ctx.logs.get("overfit_gap_ratio")))


def _run(make_trainer, detector, epochs=7):
    script = _ScriptedEpochs()
    trainer = make_trainer([script, detector], n=8, eval_n=4, max_epochs=epochs, log_every=1)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        trainer.train()
    fired = [str(w.message) for w in got if issubclass(w.category, OverfitWarning)]
    return trainer, script, fired


def test_fires_once_the_window_diverges_and_logs_the_gap_ratio_next_epoch(make_trainer):
    detector = OverfitDetection(warmup_epochs=2, window_size=2)
    trainer, script, fired = _run(make_trainer, detector)

    # Eval rises 0.7 -> 0.8 -> 0.9 over epochs 4..6 (1-based): fires at the ends of 6 and 7.
    assert len(fired) == 2
    assert "epoch 6" in fired[0] and "epoch 7" in fired[1]
    assert detector.gap_ratio == pytest.approx(1.0 / 0.4)
    assert trainer.callbacks.user_state["overfit_gap_ratio"] == pytest.approx(1.0 / 0.4)
    ratios = dict(script.logged)  # epoch (0-based) -> ratio logged during it
    assert all(ratios[e] is None for e in range(6))
    assert ratios[6] == pytest.approx(0.9 / 0.5)  # detected at the end of epoch 6 (index 5)
    assert detector.train_history == pytest.approx(TRAIN)  # two logs per epoch, averaged
    assert detector.eval_history == EVAL


def test_nothing_fires_during_the_warmup(make_trainer):
    _, _, fired = _run(make_trainer, OverfitDetection(warmup_epochs=6, window_size=2))
    assert len(fired) == 1 and "epoch 7" in fired[0]


def test_a_wide_window_needs_a_sustained_trend(make_trainer):
    _, _, fired = _run(make_trainer, OverfitDetection(warmup_epochs=0, window_size=4))
    assert fired == []


def test_after_a_healthy_epoch_the_ratio_is_cleared(make_trainer):
    detector = OverfitDetection(warmup_epochs=0, window_size=1)
    trainer = make_trainer([detector], n=8, eval_n=4, max_epochs=1, log_every=1)
    detector.gap_ratio = 3.0  # as if the previous epoch had fired
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()  # one epoch: nothing to compare with
    assert detector.gap_ratio is None
    assert "overfit_gap_ratio" not in trainer.callbacks.user_state


def test_an_epoch_without_a_logged_loss_is_left_out_with_one_warning(make_trainer):
    detector = OverfitDetection(warmup_epochs=0, window_size=1)
    trainer = make_trainer([detector], n=8, eval_n=4, max_epochs=3, log_every=0)
    with pytest.warns(UserWarning, match=r"had no logged 'loss' \(train.log_every\)") as got:
        trainer.train()
    assert len([w for w in got if "OverfitDetection" in str(w.message)]) == 1
    assert detector.train_history == []


def test_hpo_trainer_name_priority_and_validation():
    # the HPO trainer's name: the native class, taking the HPO trainer's direct hook calls too
    assert OverfitDetectionCallback.__mro__[1:3] == (HpoHooks, OverfitDetection)
    assert OverfitDetection.priority == 75
    for kwargs, named in [
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"window_size": 0}, "window_size"),
        ({"window_size": 2.0}, "window_size"),
        ({"eval_key": ""}, "eval_key"),
    ]:
        with pytest.raises(ValueError, match=named):
            OverfitDetection(**kwargs)
