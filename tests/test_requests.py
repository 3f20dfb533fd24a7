"""Requests carry values, and a kind added to the vocabulary is acted on by its one
handler, at the end of the step it was filed in, whichever loop runs (native or HF)."""

from __future__ import annotations

import pytest

from hookloop import Callback, Control, requests
from hookloop.loop.actions import handler_of, register_action, unregister_action
from hookloop.requests import KINDS, NO_REQUESTS, Requests, agree, check_kind, register_kind


@pytest.fixture
def scale_lr():
    """A valued command for the test: multiply every group's rate; records where it ran."""
    applied: list[tuple[int, float]] = []
    register_kind("scale_lr", "multiply every parameter group's learning rate")

    def handler(trainer, values) -> None:
        for group in trainer.optimizer.param_groups:
            group["lr"] *= values["factor"]
        applied.append((trainer.state.step, values["factor"]))

    register_action("scale_lr", handler)
    yield applied
    unregister_action("scale_lr")
    assert "scale_lr" not in KINDS


class FileAt(Callback):
    """Files ``scale_lr`` (twice: the first filing's values hold) during step ``step``,
    and records the logged learning rate of every log."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.logged: dict[int, float] = {}

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step:
            ctx.control.request("scale_lr", factor=0.5)
            ctx.control.request("scale_lr", factor=0.1)

    def on_log(self, ctx) -> None:
        rate = ctx.logs.get("lr", ctx.logs.get("learning_rate"))
        if rate is not None:  # (not HF's summary log at the end)
            self.logged[ctx.state.step] = rate


def test_a_valued_request_is_acted_on_at_its_steps_end_before_that_steps_log(
    make_trainer, scale_lr
):
    watch = FileAt(step=3)
    trainer = make_trainer([watch], max_steps=5, log_every=1)
    base = trainer.optimizer.param_groups[0]["lr"]
    trainer.train()
    assert scale_lr == [(3, 0.5)]
    assert watch.logged[2] == pytest.approx(base)
    assert watch.logged[3] == watch.logged[5] == pytest.approx(base * 0.5)


def test_the_hf_dialect_acts_on_a_valued_request_with_the_same_handler(scale_lr, tmp_path):
    from hookloop.compat.hf import Trainer, TrainingArguments
    from hookloop.testing import TinyModel, ToyData

    watch = FileAt(step=2)
    args = TrainingArguments(
        per_device_train_batch_size=4, max_steps=4, logging_steps=1, disable_tqdm=True,
        lr_scheduler_type="constant", learning_rate=0.1, use_cpu=True, output_dir=str(tmp_path),
    )  # fmt: skip
    trainer = Trainer(TinyModel(), args, train_dataset=ToyData(n=32), callbacks=[watch],
                      loss_fn=TinyModel.loss_fn)  # fmt: skip
    trainer.train()
    assert scale_lr == [(2, 0.5)]
    # HF logs the rate each step used: the change shows at the step after it (and the
    # schedule, constant, sets its own rate again when it steps after step 3).
    assert [watch.logged[s] for s in (1, 2, 3)] == pytest.approx([0.1, 0.1, 0.05])


def test_an_unknown_kind_is_refused_with_a_suggestion_and_the_valid_kinds():
    with pytest.raises(ValueError, match=r"unknown request kind 'stpo'.*Did you mean 'stop'\?"):
        Control().request("stpo")
    with pytest.raises(ValueError, match="Valid kinds: log, evaluate, save, stop"):
        check_kind(3)


def test_a_kind_registers_once_and_a_handler_needs_a_new_callable_kind():
    register_kind("noted_example", "a note")
    try:
        register_kind("noted_example", "a note")  # the same again: nothing happens
        with pytest.raises(ValueError, match="already registered"):
            register_kind("noted_example", "something else")
        with pytest.raises(TypeError, match="callable"):
            register_action("noted_example", "not a function")
        with pytest.raises(KeyError, match="no handler for requests of kind 'noted_example'"):
            handler_of("noted_example")
    finally:
        unregister_action("noted_example")
    with pytest.raises(ValueError, match="the loop's own"):
        register_action("save", lambda trainer, values: None)
    with pytest.raises(ValueError, match="must be an identifier"):
        register_kind("two words", "no")


def test_requests_keep_the_first_values_and_agree_to_themselves_in_one_process():
    control = Control()
    control.request_stop("first", failed=True)
    control.request_stop("second")
    control.request_rewind(4, reason="spike")
    taken = control.take()
    assert (taken.stop, taken.failed, taken.rewind.since_step) == ("first", True, 4)
    merged = taken.merge(Requests({"stop": {"reason": "later"}, "log": {}}))
    assert (merged.stop, merged.log, merged.save) == ("first", True, False)
    assert agree(taken, None) is not NO_REQUESTS and dict(agree(taken, None)) == dict(taken)
    assert control.take() is NO_REQUESTS and not control.pending


def test_each_kind_has_a_slot_by_name_whatever_order_modules_registered_them():
    kinds, fingerprint = requests.kind_layout()
    assert kinds == sorted(requests.KINDS)
    flags = [kind in ("save", "stop") for kind in kinds]
    assert requests.unpack_bits(requests.pack_bits(flags), len(kinds)) == flags
    many = [i % 3 == 0 for i in range(130)]  # three packed words
    assert len(requests.pack_bits(many)) == 3
    assert requests.unpack_bits(requests.pack_bits(many), 130) == many
    assert 0 < fingerprint < 2**56


def test_kinds_that_differ_between_ranks_are_named_with_the_ranks_that_have_them():
    error = requests.KindsDiffer.from_ranks([["log", "a"], ["log", "b"], ["log", "a", "b"]])
    assert str(error).startswith(
        "request kinds differ across ranks: 'a' on ranks 0, 2 only; 'b' on ranks 1, 2 only;"
    )
