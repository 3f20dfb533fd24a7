"""The event vocabulary: one closed set, shared by the enum and the Callback base."""

from __future__ import annotations

import pytest

from hookloop import Callback, CallbackContext, Event
from hookloop.events import (
    EPOCH_EVENTS,
    EVENT_FIELDS,
    EVENT_NAMES,
    EVENTS,
    STEP_EVENTS,
    check_event,
)


def _callback_hook_names() -> set[str]:
    return {name for name in vars(Callback) if name.startswith("on_")}


def test_callback_base_hooks_and_event_enum_are_the_same_set():
    assert _callback_hook_names() == {e.value for e in Event}
    assert set(EVENT_NAMES) == {e.value for e in Event}
    assert len(EVENT_NAMES) == len(set(EVENT_NAMES)) == len(Event)


def test_every_callback_hook_is_a_callable_no_op():
    ctx = CallbackContext()
    cb = Callback()
    for name in _callback_hook_names():
        assert getattr(cb, name)(ctx) is None


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_every_event_name_is_a_valid_key(event):
    plain = check_event(event.value)
    assert plain == event.value
    assert type(check_event(event)) is str
    assert check_event(event) == event.value
    assert event.value in EVENTS


def test_enum_members_and_plain_names_are_interchangeable_as_keys():
    table = {Event.TRAIN_END: "enum key"}
    assert table["on_train_end"] == "enum key"
    assert {"on_log": 1}[Event.LOG] == 1
    assert Event.LOG == "on_log"
    assert str(Event.EVAL_END) == "on_eval_end"
    assert f"{Event.EVAL_END}" == "on_eval_end"


def test_misspelt_event_suggests_the_closest_name_and_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        check_event("on_trian_end")
    message = str(info.value)
    assert "Did you mean 'on_train_end'" in message
    assert "'on_trian_end'" in message
    for name in EVENT_NAMES:
        assert name in message


@pytest.mark.parametrize("bad", [None, 3, "", "train_start_and_more_nonsense"])
def test_non_event_values_are_rejected_with_the_valid_list(bad):
    with pytest.raises(ValueError, match="Valid events: on_init_end"):
        check_event(bad)


def test_event_groups_and_field_table_only_name_real_events():
    assert STEP_EVENTS <= EVENTS
    assert EPOCH_EVENTS <= EVENTS
    assert set(EVENT_FIELDS) <= EVENTS


def test_event_field_table_names_only_real_context_fields():
    ctx = CallbackContext()
    for event, fields in EVENT_FIELDS.items():
        for name in fields:
            assert hasattr(ctx, name), f"{event} lists unknown ctx field {name!r}"
            assert getattr(ctx, name) is None, f"ctx.{name} is not None on a fresh context"


def test_step_events_are_those_fired_inside_one_optimizer_step():
    inside_step = {
        "on_train_step_start",
        "on_micro_step_start",
        "on_micro_step_end",
        "on_before_optimizer_step",
        "on_after_optimizer_step",
        "on_train_step_end",
        "on_before_log",
        "on_log",
    }
    assert inside_step == STEP_EVENTS
    assert {"on_epoch_start", "on_epoch_end"} == EPOCH_EVENTS
