"""EarlyStopping on scripted metric sequences, several monitors, and a real resume."""

from __future__ import annotations

import warnings

import pytest

from hookloop import Callback, Trainer
from hookloop.callbacks.early_stopping import EarlyStopping
from hookloop.compat.hpo import EarlyStoppingCallback, HpoHooks
from hookloop.testing import TinyModel, ToyData


class _Script(Callback):
    """Overwrites evaluation metrics with scripted values; the i-th evaluation during
    training happens at step 2·(i+1) (eval_every=2), so values are keyed by step."""

    priority = 0

    def __init__(self, **sequences: list[float]) -> None:
        self.sequences = sequences

    def on_eval_end(self, ctx):
        i = ctx.state.step // 2 - 1
        for key, values in self.sequences.items():
            ctx.metrics[key] = values[min(i, len(values) - 1)]


LOSS = [1.0, 0.8, 0.85, 0.9, 0.79, 0.8, 0.81, 0.82, 0.83, 0.84]  # evaluated at steps 2, 4, …


def _train(make_trainer, script, stopper, max_steps=20, **kw):
    trainer = make_trainer(
        [script, stopper], n=64, eval_n=4, max_steps=max_steps, eval_every=2, **kw
    )
    return trainer.train()


def test_stops_after_patience_evaluations_without_improvement(make_trainer):
    stopper = EarlyStopping(patience=3)
    result = _train(make_trainer, _Script(eval_loss=LOSS), stopper)

    # best 0.8 at step 4; 0.79 at step 10 improves; 12, 14, 16 do not.
    assert result.step == 16
    assert stopper.should_stop and stopper.stopped_step == 16
    assert "eval_loss (best 0.79 at step 10; 3 evaluations without" in result.stop_reason
    assert "patience=3" in result.stop_reason


def test_an_absolute_min_delta_ignores_small_improvements(make_trainer):
    stopper = EarlyStopping(patience=3, min_delta=0.02)
    result = _train(make_trainer, _Script(eval_loss=LOSS), stopper)
    assert result.step == 10  # 0.79 is not 0.02 better than 0.8
    assert stopper.trackers["eval_loss"].best == 0.8


def test_a_relative_min_delta_reads_like_the_hpo_trainer(make_trainer):
    # 0.79 is 1.25 % better than 0.8: enough for 1 %, not for 2 %.
    loose = EarlyStopping(patience=3, min_delta=0.01, threshold_mode="rel")
    assert _train(make_trainer, _Script(eval_loss=LOSS), loose).step == 16
    strict = EarlyStopping(patience=3, min_delta=0.02, threshold_mode="rel")
    assert _train(make_trainer, _Script(eval_loss=LOSS), strict).step == 10


def test_max_mode_watches_a_metric_that_should_grow(make_trainer):
    acc = [0.5, 0.6, 0.7, 0.7, 0.69, 0.71, 0.7]
    stopper = EarlyStopping("eval_acc", mode="max", patience=2)
    result = _train(make_trainer, _Script(eval_acc=acc), stopper)
    assert result.step == 10  # best 0.7 at step 6; 8 and 10 do not beat it
    assert "eval_acc" in result.stop_reason


def test_several_monitors_with_require_any_stop_when_the_first_runs_out(make_trainer):
    rising = [0.1 * i for i in range(1, 11)]  # eval_acc improves at every evaluation
    stopper = EarlyStopping(monitors={"eval_loss": "min", "eval_acc": "max"}, patience=3)
    result = _train(make_trainer, _Script(eval_loss=LOSS, eval_acc=rising), stopper)
    assert result.step == 16
    assert "eval_loss (best 0.79" in result.stop_reason and "eval_acc (" not in result.stop_reason


def test_several_monitors_with_require_all_wait_for_every_one(make_trainer):
    acc = [0.5, 0.6, 0.7, 0.8, 0.9, 0.91, 0.92, 0.92, 0.92, 0.92]  # last new best at step 14
    any_ = EarlyStopping(monitors={"eval_loss": "min", "eval_acc": "max"}, patience=3)
    all_ = EarlyStopping(
        monitors={"eval_loss": "min", "eval_acc": "max"}, patience=3, require="all"
    )
    assert _train(make_trainer, _Script(eval_loss=LOSS, eval_acc=acc), any_).step == 16
    result = _train(make_trainer, _Script(eval_loss=LOSS, eval_acc=acc), all_)
    assert result.step == 20  # eval_acc runs out only at step 20
    assert "require='all'" in result.stop_reason
    assert "eval_loss (best 0.79 at step 10; 5 evaluations" in result.stop_reason


def test_a_missing_monitor_warns_once_and_training_goes_on(make_trainer):
    stopper = EarlyStopping("eval_bleu", patience=1)
    with pytest.warns(UserWarning, match="'eval_bleu' is not among.*'eval_loss'") as got:
        result = _train(make_trainer, _Script(), stopper, max_steps=8)
    assert len([w for w in got if "eval_bleu" in str(w.message)]) == 1
    assert result.step == 8 and not stopper.should_stop


def test_evaluations_outside_training_do_not_count(make_trainer):
    stopper = EarlyStopping(patience=1)
    trainer = make_trainer([stopper], n=16, eval_n=4, max_steps=2)
    for _ in range(3):
        trainer.evaluate()
    assert stopper.trackers["eval_loss"].updates == 0


def test_state_survives_a_real_checkpoint_and_stops_at_the_same_step(make_config, tmp_path):
    def run(max_steps, out_dir, resume=None):
        stopper = EarlyStopping(patience=3)
        trainer = Trainer(
            TinyModel(),
            train_data=ToyData(64),
            eval_data=ToyData(4, seed=1),
            config=make_config(max_steps=max_steps, eval_every=2),
            callbacks=[_Script(eval_loss=LOSS), stopper],
            loss_fn=TinyModel.loss_fn,
            out_dir=out_dir,
            resume=resume,
        )
        return trainer.train(), stopper

    whole, _ = run(20, tmp_path / "whole")
    first, stopper = run(12, tmp_path / "split")  # best 0.79 at 10, one bad evaluation
    assert (first.step, stopper.trackers["eval_loss"].bad_count) == (12, 1)
    resumed, stopper = run(20, tmp_path / "split", resume="auto")
    # A stopper that forgot its state would take 0.81 (step 14) as its first best and
    # run to step 20.
    assert resumed.step == whole.step == 16
    assert resumed.stop_reason == whole.stop_reason
    assert stopper.best_steps == {"eval_loss": 10}


def test_name_keys_the_checkpoint_state_by_monitor():
    assert EarlyStopping().name == "EarlyStopping[eval_loss]"
    both = EarlyStopping(monitors={"eval_loss": "min", "eval_acc": "max"})
    assert both.name == "EarlyStopping[eval_loss,eval_acc]"
    clone = EarlyStopping(monitors={"eval_loss": "min", "eval_acc": "max"})
    both.trackers["eval_acc"].update(0.5)
    clone.load_state_dict(both.state_dict())
    assert clone.state_dict() == both.state_dict()


def test_hpo_trainer_name_priority_and_validation():
    # its HPO-trainer name lives in compat, a native subclass that also takes direct hook calls
    assert issubclass(EarlyStoppingCallback, EarlyStopping) and issubclass(
        EarlyStoppingCallback, HpoHooks
    )
    with pytest.raises(ImportError, match=r"hookloop\.compat\.hpo"):
        from hookloop.callbacks import EarlyStoppingCallback as _  # noqa: F401
    assert EarlyStopping.priority == 90
    for kwargs, named in [
        ({"mode": "down"}, "mode"),
        ({"patience": 0}, "patience"),
        ({"min_delta": -1}, "min_delta"),
        ({"threshold_mode": "pct"}, "threshold_mode"),
        ({"require": "most"}, "require"),
        ({"monitors": {}}, "monitors"),
        ({"monitors": {"eval_acc": "up"}}, "monitors"),
        ({"monitor": "eval_acc", "monitors": {"eval_loss": "min"}}, "not both"),
    ]:
        with pytest.raises(ValueError, match=named):
            EarlyStopping(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EarlyStopping()  # defaults build quietly
