"""NaNDetection: a NaN/Inf at step k ends the run at step k, without extra host reads."""

from __future__ import annotations

import math

import pytest
import torch

from hookloop import Callback, CallbackContext, ExitCode, Trainer
from hookloop.callbacks.nan_detection import (
    NaNDetection,
    is_nonfinite_stop,
)
from hookloop.compat.hpo import HpoHooks, NaNDetectionCallback
from hookloop.testing import TinyModel, ToyData


def _nan_loss_at(bad_step: int):
    """A forward step whose training loss is NaN at optimizer step ``bad_step``."""

    def forward_step(state, data, model):
        x, y = next(data)
        out = model(x)

        def loss_func(output):
            loss = torch.nn.functional.mse_loss(output, y)
            if model.training and state.step == bad_step:
                loss = loss * float("nan")
            return loss, {}

        return out, loss_func

    return forward_step


def _trainer(callbacks, cfg, forward_step=None, eval_n=None, out_dir=None):
    return Trainer(
        TinyModel(),
        train_data=ToyData(n=32),
        eval_data=ToyData(n=8, seed=1) if eval_n else None,
        config=cfg,
        callbacks=callbacks,
        forward_step=forward_step,
        loss_fn=None if forward_step else TinyModel.loss_fn,
        out_dir=out_dir,
    )


def test_a_nan_loss_at_step_k_stops_training_at_step_k(make_config):
    cb = NaNDetection()
    cfg = make_config(max_steps=20)  # skip_nonfinite is on by default
    result = _trainer([cb], cfg, _nan_loss_at(5)).train()

    assert result.step == 5
    assert cb.nan_detected
    assert "non-finite loss" in result.stop_reason and "at step 5" in result.stop_reason
    assert is_nonfinite_stop(result.stop_reason)
    assert result.exit_code == ExitCode.FAILED  # a NaN stop is a failure: exit 4


def test_without_the_callback_the_same_nan_does_not_stop_the_run(make_config):
    result = _trainer([], make_config(max_steps=20), _nan_loss_at(5)).train()
    assert result.step == 20
    assert not is_nonfinite_stop(result.stop_reason)


class _NanGradsAt(Callback):
    """Poisons the gradients (not the loss) just before the optimizer step."""

    priority = 0

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, ctx):
        if ctx.state.step == self.step:
            next(ctx.model.parameters()).grad.fill_(float("inf"))


def test_a_non_finite_gradient_with_a_finite_loss_is_named_as_the_gradient(make_config):
    cfg = make_config(max_steps=20, clip_grad_norm=None)  # the loop checks the grads themselves
    result = _trainer([_NanGradsAt(3), NaNDetection()], cfg).train()
    assert result.step == 3
    assert "non-finite gradient norm at step 3" in result.stop_reason


def test_on_a_healthy_step_it_reads_nothing_from_the_device():
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the loss was read ({name}) on a healthy step")

    cb = NaNDetection()
    ctx = CallbackContext()
    cb.on_train_start(ctx)
    ctx.loss_dict, ctx.grad_norm = {"loss": Untouchable()}, Untouchable()
    for _ in range(3):
        cb.on_train_step_end(ctx)  # the nonfinite counter did not move
    assert not ctx.control.stop_requested


def test_with_skip_nonfinite_off_it_stops_at_the_first_log_step_after_the_nan(make_config):
    cfg = make_config(max_steps=20, skip_nonfinite=False, log_every=4)
    result = _trainer([NaNDetection()], cfg, _nan_loss_at(5)).train()
    assert result.step == 8  # logged at 4 (fine) and 8 (mean includes the NaN)
    assert "non-finite loss (nan) at step 8 (logged value)" in result.stop_reason


class _ScriptedEval(Callback):
    priority = 0

    def __init__(self, values: dict[int, float]) -> None:
        self.values = values

    def on_eval_end(self, ctx):
        if ctx.state.step in self.values:
            ctx.metrics["eval_loss"] = self.values[ctx.state.step]


def test_a_non_finite_eval_loss_stops_at_that_evaluation(make_config):
    cfg = make_config(max_steps=20, eval_every=3)
    result = _trainer([_ScriptedEval({9: math.inf}), NaNDetection()], cfg, eval_n=8).train()
    assert result.step == 9
    assert "non-finite eval_loss (inf) at step 9 (evaluation value)" in result.stop_reason


def test_action_abort_ends_without_saving(make_config, tmp_path):
    cfg = make_config(max_steps=20)
    trainer = _trainer([NaNDetection(action="abort")], cfg, _nan_loss_at(4), out_dir=tmp_path)
    result = trainer.train()
    assert result.step == 4
    assert result.exit_code == ExitCode.FAILED  # failed, whatever the action
    assert is_nonfinite_stop(result.stop_reason)
    assert not (tmp_path / "checkpoints").exists() or not any(
        p.name.startswith("step-") for p in (tmp_path / "checkpoints").iterdir()
    )


def test_a_second_train_call_starts_clean(make_config):
    cb = NaNDetection()
    trainer = _trainer([cb], make_config(max_steps=6), _nan_loss_at(2))
    assert trainer.train().step == 2
    trainer.config.train.max_steps = 6
    trainer.progress.max_steps = 6
    result = trainer.train()  # step 2 is behind us; the counter baseline was re-read
    assert result.step == 6 and not cb.nan_detected


def test_hpo_trainer_name_is_the_native_class_with_direct_hooks():
    # the HPO trainer's name: the native class, taking the HPO trainer's direct hook calls too
    assert NaNDetectionCallback.__mro__[1:3] == (HpoHooks, NaNDetection)
    assert NaNDetection.priority == 5


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"keys": "loss"}, "keys"), ({"keys": []}, "keys"), ({"action": "halt"}, "action")],
)
def test_bad_arguments_raise_naming_the_parameter(kwargs, named):
    with pytest.raises(ValueError, match=named):
        NaNDetection(**kwargs)
