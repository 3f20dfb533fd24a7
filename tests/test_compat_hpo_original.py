"""The HPO trainer's built-ins behave as the original trainer's do.

Each test states what the original HPO trainer does, in its own loop (a ``Trainer``
that fires the seven events and never passes ``lr``), and checks the dialect against
numbers the test works out itself: the learning rate in every W&B row comes from
the optimizer and the rows land in the run the user opened; the loss prediction
starts at epoch 10 with a line through ``log(val_loss)`` against the evaluation's
index, read at ``max_epochs``; overfitting shows over the last ``window_size``
values once ``epoch >= warmup_epochs``; ``CheckpointCallback`` honours
``checkpoint_dir`` and ``keep_last_k`` inside a hookloop Trainer; and early-stopping
state saved in the original's shape restores counter and best.
"""

from __future__ import annotations

import math
import warnings
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hookloop.compat.hpo as hpo
from hookloop import Trainer
from hookloop.callbacks.overfit import OverfitWarning
from hookloop.checkpoint import STATE_FILE
from hookloop.testing import TinyModel, ToyData


class OriginalStyleLoop:
    """A loop written as the original trainer is: it keeps ``_total_epochs``, fires the
    seven events with the original's fields (``on_epoch_end`` has no ``lr``), steps the
    scheduler after each epoch and stops on ``should_stop`` / ``nan_detected``."""

    def __init__(self, callbacks: list, *, gamma: float = 0.5) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=gamma)
        self.callbacks = hpo.CallbackRunner(callbacks)
        self.x = torch.randn(8, 2)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.lrs: list[float] = []
        self._total_epochs = 0

    def train(self, epochs: int) -> None:
        self._total_epochs = epochs
        fire = self.callbacks.fire
        fire("on_train_begin", trainer=self, epochs=epochs)
        for epoch in range(epochs):
            fire("on_train_epoch_begin", trainer=self, epoch=epoch)
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
            loss.backward()
            self.optimizer.step()
            fire("on_train_step_end", trainer=self, batch_idx=0, loss=loss.item())
            fire("on_val_begin", trainer=self, epoch=epoch)
            with torch.no_grad():
                val = torch.nn.functional.mse_loss(self.model(self.x), -self.y).item()
            fire("on_val_end", trainer=self, epoch=epoch, val_loss=val, metrics={})
            self.lrs.append(self.optimizer.param_groups[0]["lr"])
            fire(
                "on_epoch_end", trainer=self, epoch=epoch, train_loss=loss.item(),
                val_loss=val, metrics={},
            )  # fmt: skip
            if self.callbacks.should_stop:
                break
            self.scheduler.step()
        fire("on_train_end", trainer=self)


# -- W&B: lr from the optimizer, rows in the user's run ------------------------------------


@pytest.mark.slow
def test_w_and_b_rows_read_lr_from_the_optimizer_and_go_to_the_users_run(
    monkeypatch, tmp_path, capsys
):
    wandb = pytest.importorskip("wandb")
    from hookloop.callbacks.wandb_logger import offline_history, offline_run_files

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    user_run = wandb.init(project="mine", dir=str(tmp_path), mode="offline")
    try:
        loop = OriginalStyleLoop([hpo.WandbLoggingCallback(dir=tmp_path / "unused")])
        loop.train(3)
        # on_train_end left the user's run open: it is theirs to finish
        user_run.log({"after_training": 1.0})
    finally:
        user_run.finish()

    assert len(offline_run_files(tmp_path)) == 1  # no second run was opened
    rows = offline_history(Path(user_run.dir).parent, wait_s=30)
    epoch_rows = [r for r in rows if "train_loss" in r]
    assert [r["lr"] for r in epoch_rows] == loop.lrs == [0.1, 0.05, 0.025]
    assert rows[-1]["after_training"] == 1.0
    # the console summary comes at epoch 0 and at the last epoch (the loop's _total_epochs)
    summaries = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in summaries] == ["epoch 0", "epoch 2"]
    assert summaries[-1].endswith("lr 2.50e-02")


def test_a_loop_without_an_optimizer_may_pass_lr_itself():
    logged: list[dict] = []
    callback = hpo.WandbLoggingCallback()
    callback.run = SimpleNamespace(log=logged.append, finish=lambda: None)  # an open run
    runner = hpo.CallbackRunner([callback])
    runner.fire("on_epoch_end", SimpleNamespace(), epoch=1, train_loss=1.0, val_loss=2.0, lr=0.3)
    assert logged == [{"train_loss": 1.0, "val_loss": 2.0, "lr": 0.3}]


# -- loss prediction: from epoch 10, the original's line -------------------------------------


def original_score(val_losses: list[float], max_epochs: int) -> float:
    """The original's predicted final loss, as -log10: a degree-1 fit of log(loss) against
    0, 1, 2 ..., evaluated at t = max_epochs."""
    slope, intercept = np.polyfit(np.arange(len(val_losses)), np.log(val_losses), 1)
    return float(-np.log10(np.exp(intercept + slope * max_epochs)))


def test_loss_prediction_starts_at_epoch_10_with_the_originals_fit():
    max_epochs = 30
    # not a pure exponential, so a shifted time axis would predict another value
    losses = [2.0 * math.exp(-0.3 * t) * (1 + 0.2 * math.sin(t)) for t in range(14)]
    loop = SimpleNamespace()
    runner = hpo.CallbackRunner([hpo.LossPredictionCallback(max_epochs)])
    seen = []
    for epoch, loss in enumerate(losses):
        runner.fire("on_val_end", loop, epoch=epoch, val_loss=loss, metrics={})
        seen.append(loop._loss_prediction)

    assert seen[:10] == [None] * 10  # epochs 0 to 9: nothing yet
    for epoch in range(10, 14):
        expected = original_score(losses[: epoch + 1], max_epochs)
        assert seen[epoch] == pytest.approx(expected, rel=1e-9), epoch
    # one evaluation earlier on the axis (1, 2, 3 ...) would be several percent off
    shifted = -math.log10(math.exp(np.polyfit(np.arange(1, 15), np.log(losses), 1) @ [30, 1]))
    assert abs(10 ** (seen[-1] - shifted) - 1) > 0.02


# -- overfitting: window_size values, from epoch warmup_epochs -------------------------------


def first_overfit_epoch(train, val, warmup_epochs=5, window_size=5):
    """Where the original first sees overfitting: epoch >= warmup_epochs and, over the
    last window_size values, train never rising while val never falls."""
    for epoch in range(len(train)):
        if epoch < warmup_epochs or epoch + 1 < window_size:
            continue
        first = epoch + 1 - window_size
        t, v = train[first : epoch + 1], val[first : epoch + 1]
        if all(a >= b for a, b in pairwise(t)) and all(a <= b for a, b in pairwise(v)):
            return epoch
    return None


def test_overfitting_shows_when_the_last_window_size_values_diverge():
    train = [1.0 / (epoch + 1) for epoch in range(14)]
    # val falls to its lowest at epoch 7, then rises (flat from 9 to 10)
    val = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.35, 0.4, 0.4, 0.5, 0.6, 0.7]
    loop = SimpleNamespace()
    runner = hpo.CallbackRunner([hpo.OverfitDetectionCallback()])  # warmup 5, window 5
    ratios = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch, (t, v) in enumerate(zip(train, val, strict=True)):
            runner.fire("on_epoch_end", loop, epoch=epoch, train_loss=t, val_loss=v, metrics={})
            ratios.append(loop._overfit_gap_ratio)

    fired = [epoch for epoch, ratio in enumerate(ratios) if ratio is not None]
    # values of epochs 7..11: val 0.3, 0.35, 0.4, 0.4, 0.5 never falls (a flat step counts)
    assert fired[0] == first_overfit_epoch(train, val) == 11
    assert fired == [11, 12, 13]
    assert ratios[11] == pytest.approx(val[11] / train[11])
    assert sum(issubclass(w.category, OverfitWarning) for w in caught) == 3


def test_overfitting_waits_for_the_warmup_even_when_the_trend_is_there_from_the_start():
    train = [1.0 / (epoch + 1) for epoch in range(8)]
    val = [0.1 * (epoch + 1) for epoch in range(8)]
    loop = SimpleNamespace()
    runner = hpo.CallbackRunner([hpo.OverfitDetectionCallback(warmup_epochs=5, window_size=3)])
    ratios = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverfitWarning)
        for epoch, (t, v) in enumerate(zip(train, val, strict=True)):
            runner.fire("on_epoch_end", loop, epoch=epoch, train_loss=t, val_loss=v, metrics={})
            ratios.append(loop._overfit_gap_ratio)
    assert [ratio is not None for ratio in ratios] == [False] * 5 + [True] * 3
    assert first_overfit_epoch(train, val, 5, 3) == 5


# -- checkpoints inside a hookloop Trainer: checkpoint_dir and keep_last_k ----------------


def _trainer(callbacks, make_config, out_dir=None, max_epochs=4):
    cfg = make_config(max_epochs=max_epochs)
    return Trainer(
        TinyModel(),
        train_data=ToyData(16),  # 4 steps an epoch
        eval_data=ToyData(8, seed=1),
        config=cfg,
        callbacks=callbacks,
        loss_fn=TinyModel.loss_fn,
        out_dir=None if out_dir is None else str(out_dir),
    )


def _kept(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("step-*"))


def test_inside_a_trainer_keep_last_k_1_keeps_one_checkpoint_in_checkpoint_dir(
    make_config, tmp_path
):
    checkpoint = hpo.CheckpointCallback(tmp_path / "mine", keep_last_k=1, monitor=None)
    early = hpo.EarlyStoppingCallback(patience=100)
    trainer = _trainer(hpo.CallbackRunner([checkpoint, early]).native(), make_config)
    trainer.train()

    # one directory per epoch number; the newest one is all that is left
    assert _kept(tmp_path / "mine") == ["step-00000004"]
    state = torch.load(tmp_path / "mine" / "step-00000004" / STATE_FILE, weights_only=False)
    assert state["callbacks"][early.name]["counter"] == early.trackers["eval_loss"].bad_count


def test_inside_a_trainer_the_best_is_kept_beside_the_newest(make_config, tmp_path):
    class Evals(hpo.TrainingCallback):
        def __init__(self):
            self.seen = []

        def on_val_end(self, trainer, val_loss, **kwargs):
            self.seen.append(val_loss)

    evals = Evals()
    checkpoint = hpo.CheckpointCallback(tmp_path / "mine", keep_last_k=1)
    trainer = _trainer(hpo.CallbackRunner([checkpoint, evals]).native(), make_config, max_epochs=5)
    trainer.train()

    best = evals.seen.index(min(evals.seen)) + 1
    assert set(_kept(tmp_path / "mine")) == {"step-00000005", f"step-{best:08d}"}
    assert checkpoint.best_step == best


def test_inside_a_trainer_a_keep_last_k_the_runs_retention_overrides_is_refused(
    make_config, tmp_path
):
    trainer = _trainer([hpo.CheckpointCallback(keep_last_k=1)], make_config, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"keep_last_k=1.*checkpoint.keep_last=3.*checkpoint_dir"):
        trainer.train()
    # left at its default, the run's checkpoint.keep_last decides
    default = hpo.CheckpointCallback(monitor=None)
    _trainer([default], make_config, out_dir=tmp_path / "b").train()
    assert len(_kept(tmp_path / "b" / "checkpoints")) == 3


# -- early-stopping state saved by the original -----------------------------------------------


def test_early_stopping_state_in_the_originals_shape_restores_counter_and_best():
    callback = hpo.EarlyStoppingCallback(patience=5)
    callback.load_state_dict({"counter": 3, "best_value": 0.25, "should_stop": False})
    tracker = callback.trackers["eval_loss"]
    assert (tracker.best, tracker.bad_count, callback.should_stop) == (0.25, 3, False)

    # two more evaluations that are no better end the patience of 5, as in the original
    runner = hpo.CallbackRunner([callback])
    runner.fire("on_val_end", None, epoch=10, val_loss=0.3, metrics={})
    assert not callback.should_stop
    runner.fire("on_val_end", None, epoch=11, val_loss=0.25, metrics={})
    assert callback.should_stop

    # what it saves reads back in either trainer's shape
    saved = callback.state_dict()
    assert {k: saved[k] for k in ("counter", "best_value", "should_stop")} == {
        "counter": 5,
        "best_value": 0.25,
        "should_stop": True,
    }
    again = hpo.EarlyStoppingCallback(patience=5)
    again.load_state_dict(saved)
    assert again.trackers["eval_loss"].bad_count == 5 and again.should_stop


@pytest.mark.parametrize(
    "state",
    [{}, {"counter": 1}, {"best": 0.5, "bad_count": 2}],
)
def test_early_stopping_state_of_another_shape_is_refused_by_name(state):
    with pytest.raises(ValueError, match=r"cannot load a state with keys .*'counter'"):
        hpo.EarlyStoppingCallback().load_state_dict(state)


def test_early_stopping_state_with_a_wrong_value_is_refused_by_name():
    with pytest.raises(ValueError, match="'counter' must be an int >= 0"):
        hpo.EarlyStoppingCallback().load_state_dict(
            {"counter": -1, "best_value": 0.5, "should_stop": False}
        )


def test_inside_a_trainer_the_documented_settings_give_the_originals_prediction(make_trainer):
    class Evals(hpo.TrainingCallback):
        def __init__(self):
            self.seen = []

        def on_val_end(self, trainer, val_loss, **kwargs):
            self.seen.append(val_loss)

    max_epochs = 12
    evals = Evals()
    prediction = hpo.LossPredictionCallback(max_epochs + 1, min_points=11)
    trainer = make_trainer(
        [prediction, *hpo.as_native(evals)], n=8, eval_n=8, max_epochs=max_epochs
    )
    trainer.train()  # 2 steps an epoch, one evaluation at each epoch's end

    assert len(prediction.losses) == max_epochs
    assert prediction.prediction == pytest.approx(original_score(evals.seen, max_epochs), rel=1e-9)


def test_the_renamed_monitor_attribute_and_metric_table_still_answer_with_a_warning():
    import hookloop.compat.hpo.builtins as builtins

    with pytest.warns(DeprecationWarning, match="now hpo_monitor"):
        assert hpo.EarlyStoppingCallback().seed_monitor == "val_loss"
    with pytest.warns(DeprecationWarning, match="now hpo_monitor"):
        assert hpo.CheckpointCallback(monitor=None).seed_monitor is None
    with pytest.warns(DeprecationWarning, match="now HPO_TO_NATIVE_METRIC"):
        assert builtins.SEED_TO_NATIVE_METRIC == {"val_loss": "eval_loss"}
