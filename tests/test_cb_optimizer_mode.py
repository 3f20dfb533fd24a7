"""OptimizerMode with the real schedulefree optimizers: evaluation sees the eval weights."""

from __future__ import annotations

import pytest
import torch

from hookloop import Callback, CallbackContext, Trainer
from hookloop.callbacks.optimizer_mode import OptimizerMode, has_modes
from hookloop.compat.hpo import HpoHooks, OptimizerModeCallback
from hookloop.testing import TinyModel, ToyData

schedulefree = pytest.importorskip("schedulefree")


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


class _EvalProbe(Callback):
    """Sees each evaluation from both sides of OptimizerMode (priority 10).

    Before it (on_eval_start, priority 0): the train-mode weights y and the
    optimizer's z; from them the eval weights x = (y - (1 - beta1) z) / beta1
    that schedule-free evaluation should use. During the evaluation: the weights
    the model actually runs with.
    """

    priority = 0

    def __init__(self) -> None:
        self.expected_eval: list[list[torch.Tensor]] = []
        self.train_weights: list[list[torch.Tensor]] = []
        self.seen_in_eval: list[list[torch.Tensor]] = []
        self.after_eval: list[list[torch.Tensor]] = []

    def on_eval_start(self, ctx):
        opt = ctx.optimizer
        group = opt.param_groups[0]
        beta1 = group["betas"][0] if "betas" in group else group["momentum"]
        y = _params(ctx.model)
        z = [opt.state[p]["z"].clone() for p in ctx.model.parameters()]
        self.train_weights.append(y)
        self.expected_eval.append(
            [(yi - (1 - beta1) * zi) / beta1 for yi, zi in zip(y, z, strict=True)]
        )

    def on_eval_step_start(self, ctx):
        self.seen_in_eval.append(_params(ctx.model))

    def on_train_step_start(self, ctx):  # the step after an evaluation
        if len(self.after_eval) < len(self.train_weights):
            self.after_eval.append(_params(ctx.model))


def _run(callbacks, make_config, *, mode_callback=True, optimizer_cls=None):
    model = TinyModel()
    opt = (optimizer_cls or schedulefree.AdamWScheduleFree)(model.parameters(), lr=0.05)
    cbs = [*callbacks, OptimizerMode()] if mode_callback else list(callbacks)
    if not mode_callback:
        opt.train()  # the user's manual call, or the first step raises
    cfg = make_config(max_steps=8, eval_every=4, eval_max_batches=1)
    trainer = Trainer(
        model,
        opt,
        train_data=ToyData(n=32),
        eval_data=ToyData(n=8, seed=1),
        config=cfg,
        callbacks=cbs,
        loss_fn=TinyModel.loss_fn,
    )
    trainer.train()
    return trainer


def _close(a, b):
    return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("optimizer", ["AdamWScheduleFree", "SGDScheduleFree"])
def test_evaluation_runs_on_the_eval_weights_and_training_resumes_on_the_train_weights(
    make_config, optimizer
):
    cls = getattr(schedulefree, optimizer)
    probe = _EvalProbe()
    _run([probe], make_config, optimizer_cls=cls)

    assert len(probe.seen_in_eval) == 2  # evaluations at steps 4 and 8
    runs = zip(probe.expected_eval, probe.seen_in_eval, probe.train_weights, strict=True)
    for expected, seen, train in runs:
        assert _close(seen, expected)
        assert not _close(seen, train)  # the two points really differ
    # After the step-4 evaluation, step 5 trains from the train-mode weights again.
    assert _close(probe.after_eval[0], probe.train_weights[0])


def test_without_the_callback_evaluation_sees_the_train_weights(make_config):
    probe = _EvalProbe()
    _run([probe], make_config, mode_callback=False)
    assert _close(probe.seen_in_eval[0], probe.train_weights[0])
    assert not _close(probe.seen_in_eval[0], probe.expected_eval[0])


def test_schedule_free_needs_train_mode_before_its_first_step(make_config):
    model = TinyModel()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.01)
    cfg = make_config(max_steps=2)
    with pytest.raises(Exception, match="train mode"):
        Trainer(model, opt, train_data=ToyData(16), config=cfg, loss_fn=TinyModel.loss_fn).train()
    model = TinyModel()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.01)
    trainer = Trainer(
        model,
        opt,
        train_data=ToyData(16),
        config=cfg,
        loss_fn=TinyModel.loss_fn,
        callbacks=[OptimizerMode()],
    )
    assert trainer.train().step == 2


def test_after_training_the_model_holds_the_eval_weights_and_a_second_train_continues(
    make_config,
):
    trainer = _run([], make_config)
    opt = trainer.optimizer
    assert opt.param_groups[0]["train_mode"] is False  # eval_after_training
    trainer.progress.max_steps = 12
    assert trainer.train().step == 12  # switched back to train mode at the start


def test_eval_after_training_off_leaves_train_mode_on():
    model = TinyModel()
    opt = schedulefree.AdamWScheduleFree(model.parameters())
    cb = OptimizerMode(eval_after_training=False)
    ctx = CallbackContext(model=model, optimizer=opt)
    cb.on_train_start(ctx)
    cb.on_train_end(ctx)
    assert opt.param_groups[0]["train_mode"] is True


def test_a_direct_evaluate_outside_training_leaves_eval_mode_on(make_config):
    trainer = _run([], make_config)
    trainer.optimizer.train()
    trainer.evaluate()
    assert trainer.optimizer.param_groups[0]["train_mode"] is False


def test_plain_optimizers_and_the_model_itself_are_left_alone():
    model = TinyModel()
    adamw = torch.optim.AdamW(model.parameters())
    assert not has_modes(adamw, model)
    assert not has_modes(model, model)  # a model also has train()/eval()
    assert not has_modes(torch.nn.Linear(1, 1), model)
    assert has_modes(schedulefree.AdamWScheduleFree(model.parameters()), model)

    cb = OptimizerMode()
    ctx = CallbackContext(model=model, optimizer=model)  # type: ignore[arg-type]
    cb.on_train_start(ctx)
    cb.on_eval_start(ctx)
    assert model.training  # eval() was not called on the model
    ctx = CallbackContext(model=model, optimizer=adamw)
    for handler in (cb.on_train_start, cb.on_epoch_start, cb.on_eval_start, cb.on_eval_end):
        handler(ctx)  # no train()/eval() on AdamW: nothing happens, nothing raises


def test_hpo_trainer_name_priority_and_validation():
    # the HPO trainer's name: the native class, taking the HPO trainer's direct hook calls too
    assert OptimizerModeCallback.__mro__[1:3] == (HpoHooks, OptimizerMode)
    assert OptimizerMode.priority == 10
    with pytest.raises(ValueError, match="eval_after_training"):
        OptimizerMode(eval_after_training="yes")
