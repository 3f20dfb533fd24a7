"""Calling HF's callback handler directly, as transformers' Trainer and its subclasses do
(``self.callback_handler.on_log(self.args, self.state, self.control, logs)``;
``QuestionAnsweringTrainer`` in transformers' examples calls ``on_evaluate`` with the
metrics as a fourth positional argument): the dialect's handler and transformers' own,
side by side, hand their callbacks the same values and leave the same control flags."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from hookloop.compat.hf import handler as ours  # noqa: E402


class Recorder(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(("on_log", logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append(("on_evaluate", metrics))

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self.seen.append(("on_predict", metrics))


def calls(handler_type: Any, tmp_path) -> tuple[list[tuple[str, Any]], list[dict[str, bool]]]:
    """Each event called positionally and by keyword; what the callback saw, and the
    control's flags after each call."""
    recorder = Recorder()
    handler = handler_type([recorder], None, None, None, None)
    args = transformers.TrainingArguments(str(tmp_path), report_to="none")
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    flags = []
    for event, value in (("on_log", {"loss": 1.5}), ("on_evaluate", {"eval_loss": 2.5}),
                         ("on_predict", {"test_loss": 3.5})):  # fmt: skip
        for by_name in (False, True):
            control.should_log = control.should_evaluate = control.should_save = True
            method = getattr(handler, event)
            if by_name:
                key = "logs" if event == "on_log" else "metrics"
                control = method(args, state, control, **{key: value})
            else:
                control = method(args, state, control, value)
            flags.append({k: getattr(control, k) for k in ("should_log", "should_evaluate")})
    return recorder.seen, flags


def test_the_handlers_events_take_their_value_by_position_or_by_name_as_transformers(tmp_path):
    theirs = calls(transformers.trainer_callback.CallbackHandler, tmp_path / "hf")
    assert calls(ours.CallbackHandler, tmp_path / "hookloop") == theirs
    assert [event for event, _ in theirs[0]] == ["on_log"] * 2 + ["on_evaluate"] * 2 + [
        "on_predict"
    ] * 2
