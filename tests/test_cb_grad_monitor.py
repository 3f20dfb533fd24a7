"""GradientMonitor: per-epoch max gradient norm, threshold warnings, no per-step sync."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from hookloop import Callback, CallbackContext
from hookloop.callbacks.grad_monitor import (
    GradientMonitor,
    GradientNormWarning,
    total_grad_norm,
)
from hookloop.compat.hpo import GradientMonitorCallback, HpoHooks
from hookloop.state import Progress, TrainState


class _NormRecorder(Callback):
    """Records every step's norm (pre-clipping when clipping is on) and every log."""

    priority = 0

    def __init__(self) -> None:
        self.norms: dict[int, tuple[int, float]] = {}  # step -> (epoch, norm)
        self.logged: list[tuple[int, int, float | None]] = []

    def on_before_optimizer_step(self, ctx):
        if ctx.grad_norm is not None:
            norm = ctx.grad_norm.item()
        else:
            norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ctx.model.parameters()))
        self.norms[ctx.state.step] = (ctx.state.epoch, norm)

    def on_log(self, ctx):
        self.logged.append((ctx.state.step, ctx.state.epoch, ctx.logs.get("max_grad_norm")))


@pytest.mark.parametrize("clip", [1.0, None], ids=["clipping-on", "clipping-off"])
def test_logs_carry_the_largest_norm_of_the_epoch_so_far(make_trainer, clip):
    rec, mon = _NormRecorder(), GradientMonitor()
    trainer = make_trainer([rec, mon], n=16, max_epochs=3, log_every=2, clip_grad_norm=clip)
    trainer.train()

    assert [s for s, _, _ in rec.logged] == [2, 4, 6, 8, 10, 12]
    for step, epoch, logged in rec.logged:
        so_far = [n for s, (e, n) in rec.norms.items() if e == epoch and s <= step]
        assert logged == pytest.approx(max(so_far), rel=1e-5)
    per_epoch = [max(n for e, n in rec.norms.values() if e == k) for k in range(3)]
    assert mon.epoch_maxima == pytest.approx(per_epoch, rel=1e-5)
    assert trainer.callbacks.user_state["max_grad_norm"] == pytest.approx(per_epoch[-1], rel=1e-5)


def test_a_norm_above_the_threshold_warns_naming_the_steps(make_trainer):
    rec = _NormRecorder()
    trainer = make_trainer(
        [rec, GradientMonitor(warn_threshold=1e-9)], n=16, max_steps=4, log_every=4
    )
    with pytest.warns(GradientNormWarning, match=r"on 4 step\(s\) between steps 1 and 4") as got:
        trainer.train()
    assert len([w for w in got if w.category is GradientNormWarning]) == 1  # read once, at the log
    assert f"max {max(n for _, n in rec.norms.values()):.4g}" in str(got[0].message)


def test_steps_since_the_last_log_are_checked_at_the_epoch_end(make_trainer):
    trainer = make_trainer([GradientMonitor(warn_threshold=1e-9)], n=16, max_epochs=1, log_every=0)
    with pytest.warns(GradientNormWarning, match="between steps 1 and 4"):
        trainer.train()


def test_norms_below_the_threshold_do_not_warn(make_trainer):
    trainer = make_trainer([GradientMonitor()], n=16, max_epochs=2, log_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientNormWarning)
        trainer.train()


def test_the_step_path_never_reads_a_tensor_back_to_the_host(monkeypatch):
    mon = GradientMonitor(warn_threshold=2.5)
    progress = Progress()
    ctx = CallbackContext(state=TrainState(progress))
    mon.on_epoch_start(ctx)

    def refuse(*args, **kwargs):
        raise AssertionError("host read on a step that logs nothing")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for step, norm in enumerate([1.0, 3.0, float("nan"), 2.0], start=1):
        progress.step = step
        ctx.grad_norm = torch.tensor(norm)
        mon.on_before_optimizer_step(ctx)
    monkeypatch.undo()

    ctx.logs = {}
    with pytest.warns(GradientNormWarning, match=r"on 1 step\(s\) between steps 1 and 4 \(max 3\)"):
        mon.on_before_log(ctx)
    assert ctx.logs["max_grad_norm"] == 3.0  # the NaN was ignored


def test_epoch_maxima_survive_a_real_checkpoint_resume(make_config, tmp_path):
    from hookloop import Trainer
    from hookloop.testing import TinyModel, ToyData

    def run(max_steps, out_dir, resume=None):
        mon = GradientMonitor()
        cfg = make_config(max_steps=max_steps, log_every=5)
        Trainer(
            TinyModel(),
            train_data=ToyData(16),
            config=cfg,
            callbacks=[mon],
            loss_fn=TinyModel.loss_fn,
            out_dir=out_dir,
            resume=resume,
        ).train()
        return mon

    whole = run(12, tmp_path / "whole")
    split = run(6, tmp_path / "split")  # mid-epoch 2; step 6 not read yet (logs at 5, 10)
    assert split.state_dict()["window_steps"] == [6, 6]
    resumed = run(12, tmp_path / "split", resume="auto")
    assert len(whole.epoch_maxima) == 3
    assert resumed.epoch_maxima == whole.epoch_maxima
    assert resumed.state_dict() == whole.state_dict()


def test_total_grad_norm_matches_the_definition():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    assert total_grad_norm(grads).item() == pytest.approx(5.0)
    assert total_grad_norm([]) is None


def test_hpo_trainer_name_priority_and_validation():
    # the HPO trainer's name: the native class, taking the HPO trainer's direct hook calls too
    assert GradientMonitorCallback.__mro__[1:3] == (HpoHooks, GradientMonitor)
    assert GradientMonitor.priority == 12
    for bad in (0, -1.0, "big", True):
        with pytest.raises(ValueError, match="warn_threshold"):
            GradientMonitor(warn_threshold=bad)
