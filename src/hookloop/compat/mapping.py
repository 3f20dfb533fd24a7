"""The one table that says which dialect events each native event becomes.

Every adapter in :mod:`hookloop.compat` reads its dispatch from here, so the
dialects cannot drift apart from each other or from the native order: when a
native event fires, a dialect's events are fired in the order listed. A native
event missing from a dialect's column has no counterpart there.

>>> dialect_events("hpo")["on_train_start"]
('on_train_begin',)
>>> sorted(n for n in dialect_event_names("hf") if n.startswith("on_log"))
['on_log', 'on_log_step']
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from hookloop.events import EVENT_NAMES

DIALECTS = ("megatron_bridge", "hpo", "hf")

# native event -> {dialect: dialect events fired for it, in order}
_TABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "on_init_end": {"hf": ("on_init_end",)},
    "on_data_init_start": {"megatron_bridge": ("on_data_init_start",)},
    "on_train_start": {
        "megatron_bridge": ("on_train_start",),
        "hpo": ("on_train_begin",),
        "hf": ("on_train_begin",),
    },
    "on_epoch_start": {"hpo": ("on_train_epoch_begin",), "hf": ("on_epoch_begin",)},
    "on_train_step_start": {
        "megatron_bridge": ("on_train_step_start",),
        "hf": ("on_step_begin",),
    },
    "on_micro_step_start": {"hf": ("on_forward_backward_begin",)},
    # on_substep_end fires for every micro-step but the last of an optimizer step.
    "on_micro_step_end": {"hf": ("on_forward_backward_end", "on_substep_end")},
    "on_before_optimizer_step": {"hf": ("on_pre_optimizer_step",)},
    "on_after_optimizer_step": {"hf": ("on_optimizer_step",)},
    "on_train_step_end": {
        "megatron_bridge": ("on_train_step_end",),
        "hpo": ("on_train_step_end",),
        "hf": ("on_step_end", "on_train_metrics"),
    },
    # A live `set` (hookloop.loop.live): no other system changes settings mid-run.
    "on_settings_change": {},
    "on_before_log": {"hf": ("on_log_step",)},
    "on_log": {"hf": ("on_log",)},
    "on_eval_start": {"megatron_bridge": ("on_eval_start",), "hpo": ("on_val_begin",)},
    "on_eval_step_start": {"megatron_bridge": ("on_eval_step_start",)},
    "on_eval_step_end": {
        "megatron_bridge": ("on_eval_step_end",),
        "hf": ("on_prediction_step",),
    },
    # HF's Trainer also reports evaluation metrics through on_log, just before on_evaluate,
    # so loggers written for it (PrinterCallback, integrations) see them.
    "on_eval_end": {
        "megatron_bridge": ("on_eval_end",),
        "hpo": ("on_val_end",),
        "hf": ("on_log", "on_evaluate"),
    },
    "on_test_start": {"megatron_bridge": ("on_test_start",)},
    "on_test_step_start": {"megatron_bridge": ("on_test_step_start",)},
    # HF's predict() runs its evaluation loop, which reports each batch as evaluate()'s does.
    "on_test_step_end": {"megatron_bridge": ("on_test_step_end",), "hf": ("on_prediction_step",)},
    "on_test_end": {"megatron_bridge": ("on_test_end",), "hf": ("on_predict",)},
    "on_epoch_end": {"hpo": ("on_epoch_end",), "hf": ("on_epoch_end",)},
    "on_checkpoint_save": {"megatron_bridge": ("on_checkpoint_save",), "hf": ("on_save",)},
    # Megatron-Bridge has no load event (native callbacks on manager.native get this one).
    "on_checkpoint_load": {},
    "on_exception": {},
    "on_train_end": {
        "megatron_bridge": ("on_train_end",),
        "hpo": ("on_train_end",),
        "hf": ("on_train_end",),
    },
}

assert set(_TABLE) == set(EVENT_NAMES), set(_TABLE) ^ set(EVENT_NAMES)


def _check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; the dialects are {', '.join(DIALECTS)}")


def dialect_events(dialect: str) -> Mapping[str, tuple[str, ...]]:
    """``{native event: dialect events}`` for one dialect; natives with no counterpart omitted."""
    _check_dialect(dialect)
    return MappingProxyType(
        {native: row[dialect] for native, row in _TABLE.items() if dialect in row}
    )


def dialect_event_names(dialect: str) -> tuple[str, ...]:
    """Every event name of a dialect, in native firing order, each once."""
    names: dict[str, None] = {}
    for events in dialect_events(dialect).values():
        names.update(dict.fromkeys(events))
    return tuple(names)


def table() -> list[tuple[str, dict[str, tuple[str, ...]]]]:
    """The whole table as rows ``(native, {dialect: events})``, for docs and tests."""
    return [(native, dict(row)) for native, row in _TABLE.items()]


def markdown_table() -> str:
    """The table as Markdown, one row per native event, as docs/callbacks.md shows it.

    >>> print(markdown_table().splitlines()[2])
    | `on_init_end` | - | - | `on_init_end` |
    """
    titles = {
        "megatron_bridge": "Megatron-Bridge",
        "hpo": "the HPO trainer",
        "hf": "transformers' Trainer",
    }
    lines = [
        "| native | " + " | ".join(titles[d] for d in DIALECTS) + " |",
        "|---" * (len(DIALECTS) + 1) + "|",
    ]
    for native, row in _TABLE.items():
        cells = [", ".join(f"`{e}`" for e in row[d]) if d in row else "-" for d in DIALECTS]
        lines.append(f"| `{native}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
