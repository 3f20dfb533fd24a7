"""``train.gc_every``: automatic GC off in training, a collection every N steps, the
set-up objects frozen, and the collector given back afterwards (also after an error)."""

from __future__ import annotations

import gc

import pytest

from hookloop import Callback, CallbackManager, Config, DataConfig, TrainConfig, Trainer
from hookloop.gcpolicy import GCPolicy
from hookloop.testing import TinyModel, ToyData


@pytest.fixture
def collections():
    """Steps at which a full collection ran once training began (through gc.callbacks)."""
    seen: list[int] = []
    step: dict[str, int | None] = {"now": None}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2 and step["now"] is not None:
            seen.append(step["now"])

    gc.callbacks.append(on_gc)
    yield seen, step
    gc.callbacks.remove(on_gc)


class _Watch(Callback):
    """Records whether automatic GC is on at each step, and tells the fixture the step."""

    def __init__(self, step: dict, fail_at: int | None = None) -> None:
        self.step, self.fail_at, self.enabled = step, fail_at, []

    def on_train_start(self, ctx) -> None:
        self.step["now"] = 0  # set-up is over (collections before this are the interpreter's)

    def on_train_step_start(self, ctx) -> None:
        self.step["now"] = ctx.state.step

    def on_train_step_end(self, ctx) -> None:
        self.enabled.append(gc.isenabled())
        if ctx.state.step == self.fail_at:
            raise RuntimeError("boom")


def _trainer(watch: Callback, **train) -> Trainer:
    cfg = Config(
        train=TrainConfig(max_steps=6, log_every=0, eval_at_epoch_end=False, **train),
        data=DataConfig(batch_size=4),
    )
    return Trainer(
        TinyModel(), train_data=ToyData(n=64), loss_fn=TinyModel.loss_fn, config=cfg,
        callbacks=CallbackManager([watch]),
    )  # fmt: skip


def test_gc_runs_every_n_steps_with_automatic_collection_off(collections):
    seen, step = collections
    watch = _Watch(step)
    assert gc.isenabled()
    _trainer(watch, gc_every=2).train()
    assert watch.enabled == [False] * 6  # automatic collection is off while training
    # One collection after set-up (before step 1), then after steps 2, 4 and 6.
    assert seen == [0, 2, 4, 6]
    assert gc.isenabled() and gc.get_freeze_count() == 0  # given back as found


@pytest.mark.parametrize("gc_eval", [True, False])
def test_evaluations_in_training_are_collected_before_and_after_unless_switched_off(
    collections, gc_eval
):
    seen, step = collections
    cfg = Config(
        train=TrainConfig(max_steps=6, log_every=0, eval_every=3, eval_at_epoch_end=False,
                          gc_every=2, gc_eval=gc_eval),
        data=DataConfig(batch_size=4),
    )  # fmt: skip
    Trainer(
        TinyModel(), train_data=ToyData(n=64), eval_data=ToyData(n=8, seed=1),
        loss_fn=TinyModel.loss_fn, config=cfg, callbacks=CallbackManager([_Watch(step)]),
    ).train()  # fmt: skip
    # After set-up, after steps 2, 4, 6; around the evaluations after steps 3 and 6.
    assert seen == ([0, 2, 3, 3, 4, 6, 6, 6] if gc_eval else [0, 2, 4, 6])


def test_setup_objects_are_frozen_during_training():
    counts: list[int] = []

    class FreezeCount(Callback):
        def on_train_step_end(self, ctx) -> None:
            counts.append(gc.get_freeze_count())

    _trainer(FreezeCount(), gc_every=3).train()
    assert counts and all(c > 0 for c in counts)  # the model, data and trainer among them
    assert gc.get_freeze_count() == 0


def test_without_gc_every_the_interpreter_keeps_its_collector(collections):
    _, step = collections
    watch = _Watch(step)
    _trainer(watch).train()
    assert watch.enabled == [True] * 6


def test_an_exception_in_training_gives_the_collector_back(collections):
    _, step = collections
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(_Watch(step, fail_at=3), gc_every=2).train()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_collector_switched_off_by_the_user_stays_off():
    policy = GCPolicy(5)
    gc.disable()
    try:
        policy.begin()
        policy.end()
        assert not gc.isenabled()
    finally:
        gc.enable()
    policy.end()  # ending twice, or without beginning, does nothing
    assert gc.isenabled()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_gc_every_names_the_key_and_what_is_allowed(bad):
    with pytest.raises(ValueError, match=r"train\.gc_every must be an int >= 1"):
        Config(train=TrainConfig(gc_every=bad)).validate()
    with pytest.raises(ValueError, match="gc every must be an int >= 1 or None"):
        GCPolicy(bad)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_bad_gc_eval_names_the_key_and_what_is_allowed(bad):
    with pytest.raises(ValueError, match=r"train\.gc_eval must be true or false"):
        Config(train=TrainConfig(gc_eval=bad)).validate()
