"""CheckpointPolicy asks the CheckpointManager for saves at the right steps and epochs."""

from __future__ import annotations

from pathlib import Path

import pytest

from hookloop import Callback, Trainer
from hookloop.callbacks.checkpoint_policy import CheckpointPolicy
from hookloop.compat.hpo import CheckpointCallback, HpoHooks
from hookloop.testing import TinyModel, ToyData


def _saved_steps(out_dir: Path) -> list[int]:
    root = out_dir / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if p.is_dir())


def _trainer(
    make_config, callbacks, out_dir, *, resume=None, eval_n=None, checkpoint=None, **train
):
    cfg = make_config(**train)
    cfg.checkpoint.keep_last = None  # keep everything: the test reads what was written
    cfg.checkpoint.save_on_end = False
    for key, value in (checkpoint or {}).items():
        setattr(cfg.checkpoint, key, value)
    return Trainer(
        TinyModel(),
        train_data=ToyData(16),  # 4 steps an epoch
        eval_data=ToyData(4, seed=1) if eval_n else None,
        config=cfg,
        callbacks=callbacks,
        loss_fn=TinyModel.loss_fn,
        out_dir=str(out_dir),
        resume=resume,
    )


def test_every_n_epochs_saves_at_the_end_of_those_epochs(make_config, tmp_path):
    _trainer(make_config, [CheckpointPolicy(every_n_epochs=2)], tmp_path, max_epochs=5).train()
    assert _saved_steps(tmp_path) == [8, 16]


def test_every_n_steps_saves_at_those_steps(make_config, tmp_path):
    policy = CheckpointPolicy(every_n_epochs=None, every_n_steps=3)
    _trainer(make_config, [policy], tmp_path, max_steps=10).train()
    assert _saved_steps(tmp_path) == [3, 6, 9]


def test_without_the_callback_nothing_is_saved(make_config, tmp_path):
    _trainer(make_config, [], tmp_path, max_steps=10).train()
    assert _saved_steps(tmp_path) == []


class _Script(Callback):
    priority = 0

    def __init__(self, values: dict[int, float], key: str = "eval_loss") -> None:
        self.values, self.key = values, key

    def on_eval_end(self, ctx):
        ctx.metrics[self.key] = self.values[ctx.state.step]


SCRIPT = {2: 1.0, 4: 0.9, 6: 0.95, 8: 0.8, 10: 0.85, 12: 0.82}


def test_a_new_best_is_saved_and_remembered(make_config, tmp_path):
    policy = CheckpointPolicy(every_n_epochs=None, monitor="eval_loss")
    trainer = _trainer(
        make_config, [_Script(SCRIPT), policy], tmp_path, eval_n=4, max_steps=12, eval_every=2
    )
    trainer.train()
    assert _saved_steps(tmp_path) == [2, 4, 8]
    assert Path(policy.best_path).name == "step-00000008"
    assert (policy.best_step, policy.best_value) == (8, 0.8)
    assert trainer.callbacks.user_state["best_checkpoint"] == policy.best_path


def test_max_mode_and_the_state_survive_a_resume(make_config, tmp_path):
    acc = {2: 0.5, 4: 0.7, 6: 0.6, 8: 0.65, 10: 0.75, 12: 0.7}
    first = CheckpointPolicy(every_n_epochs=None, monitor="eval_acc", mode="max")
    kw = {"eval_n": 4, "eval_every": 2}
    script = _Script(acc, key="eval_acc")
    trainer = _trainer(
        make_config, [script, first], tmp_path, max_steps=6, checkpoint={"save_on_end": True}, **kw
    )
    trainer.train()  # saves at 2, 4 (bests) and 6 (the end)
    second = CheckpointPolicy(every_n_epochs=None, monitor="eval_acc", mode="max")
    _trainer(make_config, [script, second], tmp_path, resume="auto", max_steps=12, **kw).train()
    assert (second.best_value, second.best_step) == (0.75, 10)  # 0.65 at 8 did not beat 0.7
    assert _saved_steps(tmp_path) == [2, 4, 6, 10]
    assert Path(second.best_path).name == "step-00000010"


def test_a_checkpoint_saved_at_a_new_best_knows_it_is_the_best_after_resume(make_config, tmp_path):
    policy = CheckpointPolicy(every_n_epochs=None, monitor="eval_loss")
    _trainer(
        make_config, [_Script(SCRIPT), policy], tmp_path, eval_n=4, max_steps=8, eval_every=2
    ).train()
    resumed = CheckpointPolicy(every_n_epochs=None, monitor="eval_loss")
    trainer = _trainer(
        make_config, [_Script(SCRIPT), resumed], tmp_path, resume="auto", eval_n=4, max_steps=8
    )
    trainer.load_checkpoint("auto")
    assert Path(resumed.best_path).name == "step-00000008"
    assert trainer.callbacks.user_state["best_checkpoint"] == resumed.best_path


def test_without_out_dir_it_warns_that_nothing_can_be_saved(make_trainer):
    with pytest.warns(UserWarning, match="no out_dir"):
        make_trainer([CheckpointPolicy()], n=16, max_steps=2).train()


def test_it_warns_when_retention_could_delete_the_best(make_config, tmp_path):
    policy = CheckpointPolicy(monitor="eval_loss")
    trainer = _trainer(make_config, [policy], tmp_path, max_steps=2, checkpoint={"keep_last": 2})
    with pytest.warns(UserWarning, match="checkpoint.monitor=eval_loss"):
        trainer.train()


def test_hpo_trainer_name_priority_and_validation():
    # its HPO-trainer name lives in compat, a native subclass that also takes direct hook calls
    assert issubclass(CheckpointCallback, CheckpointPolicy) and issubclass(
        CheckpointCallback, HpoHooks
    )
    with pytest.raises(ImportError, match=r"hookloop\.compat\.hpo"):
        from hookloop.callbacks import CheckpointCallback as _  # noqa: F401
    assert CheckpointPolicy.priority == 95
    for kwargs, named in [
        ({"every_n_epochs": 0}, "every_n_epochs"),
        ({"every_n_steps": 1.5}, "every_n_steps"),
        ({"monitor": "eval_loss", "mode": "lowest"}, "mode"),
        ({"monitor": ""}, "monitor"),
        ({"every_n_epochs": None}, "every_n_epochs, every_n_steps or monitor"),
    ]:
        with pytest.raises(ValueError, match=named):
            CheckpointPolicy(**kwargs)


def test_a_save_requested_at_the_last_epoch_end_is_written(make_config, tmp_path):
    _trainer(make_config, [CheckpointPolicy(every_n_epochs=2)], tmp_path, max_epochs=4).train()
    assert _saved_steps(tmp_path) == [8, 16]
