"""The Schedule's answers at an epoch's end, and a dialect changing them by a Flow.

The loop tells the schedule why an epoch's steps ended (an :class:`EpochEnd`) and
carries out the :class:`EpochPlan` it gets back; a dialect changes a decision by
giving the native schedule a :class:`Flow`, not by subclassing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hookloop.loop.parts import Dialect
from hookloop.loop.schedule import Action, EpochEnd, Flow, Schedule
from hookloop.loop.trainer import Trainer
from hookloop.testing import RecordingCallback, TinyModel, ToyData


def _trainer(config: Any, flow: Flow | None, callbacks: Any = None) -> Trainer:
    dialect = None if flow is None else Dialect(flow=lambda p: flow)
    return Trainer(
        TinyModel(),
        train_data=ToyData(16),  # batch 4: 4 steps an epoch
        config=config,
        loss_fn=TinyModel.loss_fn,
        callbacks=callbacks,
        dialect=dialect,
    )


def test_an_epoch_left_mid_way_has_no_end_and_a_full_one_moves_on(make_config):
    schedule = _trainer(make_config(max_steps=6), None).schedule
    st = schedule.progress

    st.epoch_step = 2  # the budget spent mid-epoch: training ends, the epoch does not
    mid = schedule.at_epoch_end(EpochEnd.BUDGET)
    assert (mid.stop_reason, mid.closes, mid.evaluates_first) == ("max_steps", False, False)

    st.epoch_step = 4  # the budget spent exactly at the epoch's end: the epoch ends too
    full = schedule.at_epoch_end(EpochEnd.BUDGET)
    assert (full.stop_reason, full.closes, full.advances) == ("max_steps", True, True)

    stopped = schedule.at_epoch_end(EpochEnd.STOPPED)  # a stop mid-epoch decides nothing more
    assert (stopped.stop_reason, stopped.closes) == (None, False)


def test_a_flow_ends_every_epoch_early_and_reopens_it(make_config):
    rec = RecordingCallback(events=["on_epoch_start", "on_epoch_end"])
    holder: list[Trainer] = []

    def two_steps() -> bool:
        return holder[0].progress.epoch_step == 2

    flow = Flow(opens_every_epoch=True, closes_every_epoch=True, epoch_stop=two_steps)
    trainer = _trainer(make_config(max_epochs=2), flow, [rec])
    holder.append(trainer)

    result = trainer.train()

    assert (result.step, result.epoch, result.stop_reason) == (4, 2, "max_epochs")
    assert rec.events == [
        ("on_epoch_start", 0, 0),
        ("on_epoch_end", 2, 0),
        ("on_epoch_start", 2, 0),
        ("on_epoch_end", 4, 0),
    ]
    # without the flow the same run steps whole epochs
    assert _trainer(make_config(max_epochs=2), None).train().step == 8


def test_a_flow_that_decides_plans_every_step_end(make_config):
    rec = RecordingCallback(events=["on_log", "on_epoch_end"])

    def decide(schedule: Schedule) -> Iterator[Action]:
        yield "log", {}
        if schedule.progress.step == 3:
            yield "stop", {"reason": "the flow's own stop"}

    trainer = _trainer(make_config(max_epochs=2), Flow(decide=decide), [rec])

    result = trainer.train()

    assert (result.step, result.stop_reason) == (3, "the flow's own stop")
    # log_every=0: each log is the flow's; stopped mid-epoch, the epoch has no end
    assert rec.events == [("on_log", 1, 0), ("on_log", 2, 0), ("on_log", 3, 0)]
