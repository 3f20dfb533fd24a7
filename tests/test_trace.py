"""Golden trace: the exact order of events in a small run, written out literally.

Run: TinyModel on ToyData(n=16), batch 4, grad_accum 2 (so 2 optimizer steps an
epoch), 2 epochs, log every 2 steps, evaluate every 3 steps and at each epoch end
on 8 samples (2 evaluation batches). The order follows DESIGN.md: step start,
k x (micro start, micro end), before/after optimizer step, step end; then logging
(before_log, log) and evaluation when due; epoch-end evaluation before on_epoch_end.
"""

from __future__ import annotations

from _golden import golden_run_config
from hookloop import Trainer
from hookloop.testing import RecordingCallback, TinyModel, ToyData

EXPECTED = [
    ("on_init_end", 0, 0),
    ("on_data_init_start", 0, 0),
    ("on_train_start", 0, 0),
    # epoch 1
    ("on_epoch_start", 0, 0),
    ("on_train_step_start", 1, 0),
    ("on_micro_step_start", 1, 0),
    ("on_micro_step_end", 1, 0),
    ("on_micro_step_start", 1, 1),
    ("on_micro_step_end", 1, 1),
    ("on_before_optimizer_step", 1, 0),
    ("on_after_optimizer_step", 1, 0),
    ("on_train_step_end", 1, 0),
    ("on_train_step_start", 2, 0),
    ("on_micro_step_start", 2, 0),
    ("on_micro_step_end", 2, 0),
    ("on_micro_step_start", 2, 1),
    ("on_micro_step_end", 2, 1),
    ("on_before_optimizer_step", 2, 0),
    ("on_after_optimizer_step", 2, 0),
    ("on_train_step_end", 2, 0),
    ("on_before_log", 2, 0),  # log_every=2
    ("on_log", 2, 0),
    ("on_eval_start", 2, 0),  # epoch-end evaluation, before on_epoch_end
    ("on_eval_step_start", 2, 0),
    ("on_eval_step_end", 2, 0),
    ("on_eval_step_start", 2, 0),
    ("on_eval_step_end", 2, 0),
    ("on_eval_end", 2, 0),
    ("on_epoch_end", 2, 0),
    # epoch 2
    ("on_epoch_start", 2, 0),
    ("on_train_step_start", 3, 0),
    ("on_micro_step_start", 3, 0),
    ("on_micro_step_end", 3, 0),
    ("on_micro_step_start", 3, 1),
    ("on_micro_step_end", 3, 1),
    ("on_before_optimizer_step", 3, 0),
    ("on_after_optimizer_step", 3, 0),
    ("on_train_step_end", 3, 0),
    ("on_eval_start", 3, 0),  # eval_every=3
    ("on_eval_step_start", 3, 0),
    ("on_eval_step_end", 3, 0),
    ("on_eval_step_start", 3, 0),
    ("on_eval_step_end", 3, 0),
    ("on_eval_end", 3, 0),
    ("on_train_step_start", 4, 0),
    ("on_micro_step_start", 4, 0),
    ("on_micro_step_end", 4, 0),
    ("on_micro_step_start", 4, 1),
    ("on_micro_step_end", 4, 1),
    ("on_before_optimizer_step", 4, 0),
    ("on_after_optimizer_step", 4, 0),
    ("on_train_step_end", 4, 0),
    ("on_before_log", 4, 0),
    ("on_log", 4, 0),
    ("on_eval_start", 4, 0),  # epoch-end evaluation
    ("on_eval_step_start", 4, 0),
    ("on_eval_step_end", 4, 0),
    ("on_eval_step_start", 4, 0),
    ("on_eval_step_end", 4, 0),
    ("on_eval_end", 4, 0),
    ("on_epoch_end", 4, 0),
    ("on_train_end", 4, 0),
]


def test_native_event_order_matches_the_golden_trace():
    rec = RecordingCallback()
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(n=16),
        eval_data=ToyData(n=8, seed=1),
        loss_fn=TinyModel.loss_fn,
        config=golden_run_config(),
        callbacks=[rec],
    )
    result = trainer.train()

    assert rec.events == EXPECTED
    assert (result.step, result.epoch) == (4, 2)


def test_test_after_training_appends_only_test_events():
    rec = RecordingCallback()
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(n=16),
        eval_data=ToyData(n=8, seed=1),
        test_data=ToyData(n=8, seed=2),
        loss_fn=TinyModel.loss_fn,
        config=golden_run_config(),
        callbacks=[rec],
    )
    trainer.train()
    del rec.events[: len(EXPECTED)]
    trainer.test()
    assert rec.events == [
        ("on_test_start", 4, 0),
        ("on_test_step_start", 4, 0),
        ("on_test_step_end", 4, 0),
        ("on_test_step_start", 4, 0),
        ("on_test_step_end", 4, 0),
        ("on_test_end", 4, 0),
    ]
