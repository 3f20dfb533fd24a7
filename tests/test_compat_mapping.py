"""The one native-to-dialect table: complete, consistent, and the one docs/callbacks.md shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from hookloop.compat.mapping import (
    DIALECTS,
    dialect_event_names,
    dialect_events,
    markdown_table,
    table,
)
from hookloop.events import EVENT_NAMES

CALLBACKS_DOC = Path(__file__).resolve().parent.parent / "docs" / "callbacks.md"


def test_every_native_event_has_a_row_in_firing_order():
    assert [native for native, _ in table()] == [n for n in EVENT_NAMES]


def test_each_dialect_has_the_event_count_its_system_documents():
    # Megatron-Bridge: 4 train + 4 eval + 4 test events, plus data-init and checkpoint save;
    # the HPO trainer: seven events; transformers' Trainer: nineteen events.
    assert len(dialect_event_names("megatron_bridge")) == 14
    assert len(dialect_event_names("hpo")) == 7
    assert len(dialect_event_names("hf")) == 19


def test_only_hf_on_log_and_on_prediction_step_are_fired_by_two_native_events():
    # HF's Trainer reports evaluation metrics through on_log as well as training logs, and
    # each batch of evaluate() and of predict() (both its evaluation loop) to on_prediction_step.
    shared = {}
    for dialect in DIALECTS:
        seen: dict[str, list[str]] = {}
        for native, events in dialect_events(dialect).items():
            for event in events:
                seen.setdefault(event, []).append(native)
        shared[dialect] = {e: n for e, n in seen.items() if len(n) > 1}
    assert shared == {
        "megatron_bridge": {},
        "hpo": {},
        "hf": {
            "on_log": ["on_log", "on_eval_end"],
            "on_prediction_step": ["on_eval_step_end", "on_test_step_end"],
        },
    }


def test_an_unknown_dialect_is_refused_with_the_known_ones_listed():
    with pytest.raises(ValueError, match=r"unknown dialect 'lightning'.*megatron_bridge, hpo, hf"):
        dialect_events("lightning")


def test_megatron_bridges_column_names_exactly_its_callback_modules_events():
    from hookloop.compat.megatron_bridge.training.callbacks import VALID_EVENTS

    assert set(dialect_event_names("megatron_bridge")) == VALID_EVENTS


def test_the_callbacks_doc_shows_exactly_this_table():
    header = markdown_table().splitlines()[0]
    assert header == "| native | Megatron-Bridge | the HPO trainer | transformers' Trainer |"
    assert markdown_table() in CALLBACKS_DOC.read_text(encoding="utf-8")
