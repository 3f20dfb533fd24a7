"""The seed-001 callback base: seven events, hooks ``(self, trainer, **fields)``, a priority.

The seven event names come from :mod:`hookloop.compat.mapping`, in the order a
training run fires them:

>>> for event in EVENTS:
...     print(event)
on_train_begin
on_train_epoch_begin
on_train_step_end
on_val_begin
on_val_end
on_epoch_end
on_train_end
"""

from __future__ import annotations

import difflib
from typing import Any

from hookloop.compat.mapping import dialect_event_names, dialect_events

#: The seed-001 events, in firing order.
EVENTS: tuple[str, ...] = dialect_event_names("hpo")


class TrainingCallback:
    """Base class for seed-001 callbacks: override the hooks you need; the others do nothing.

    A hook receives the trainer, then keyword fields that depend on the event
    (inside a hookloop Trainer: :data:`hookloop.compat.hpo.FIELDS`). End every
    hook's signature with ``**kwargs`` so a field it does not name never breaks it.

    ``priority`` orders callbacks within an event: lower runs earlier, equal
    priorities keep their list order. The default, 50, is hookloop's band for
    user callbacks (after bookkeeping and metric producers, before deciders).
    Setting ``should_stop`` or ``nan_detected`` to True asks the trainer to stop.
    """

    #: Lower runs earlier; equal priorities keep list order.
    priority: int = 50

    def on_train_begin(self, trainer: Any, **kwargs: Any) -> None:
        """Once, before the first epoch."""

    def on_train_epoch_begin(self, trainer: Any, **kwargs: Any) -> None:
        """At the start of each training epoch."""

    def on_train_step_end(self, trainer: Any, **kwargs: Any) -> None:
        """After each optimizer step."""

    def on_val_begin(self, trainer: Any, **kwargs: Any) -> None:
        """Before each validation pass."""

    def on_val_end(self, trainer: Any, **kwargs: Any) -> None:
        """After each validation pass, with its results."""

    def on_epoch_end(self, trainer: Any, **kwargs: Any) -> None:
        """At the end of each epoch, after its validation."""

    def on_train_end(self, trainer: Any, **kwargs: Any) -> None:
        """Once, when training is over."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"


assert {n for n in vars(TrainingCallback) if n.startswith("on_")} == set(EVENTS)


def check_event(name: object) -> str:
    """Return ``name`` if it is a seed-001 event; else raise ``ValueError`` with a suggestion."""
    if isinstance(name, str) and name in EVENTS:
        return name
    raise ValueError(unknown_event_message(name))


def unknown_event_message(name: object) -> str:
    hint = ""
    if isinstance(name, str):
        counterpart = dialect_events("hpo").get(name)
        close = difflib.get_close_matches(name, EVENTS, n=1, cutoff=0.6)
        if counterpart:
            hint = f" {name!r} is a native hookloop event; seed 001 calls it {counterpart[0]!r}."
        elif close:
            hint = f" Did you mean {close[0]!r}?"
    return f"unknown seed-001 event {name!r}.{hint} The events are: {', '.join(EVENTS)}."


def overridden_hooks(callback: TrainingCallback) -> frozenset[str]:
    """The events whose hook ``callback``'s class overrides (the others are no-ops)."""
    cls = type(callback)
    return frozenset(e for e in EVENTS if getattr(cls, e) is not getattr(TrainingCallback, e))


def check_training_callback(callback: TrainingCallback) -> None:
    """Reject a non-int ``priority``, and ``on_*`` methods that match no event (typos never run)."""
    name = type(callback).__name__
    priority = getattr(callback, "priority", None)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"{name}.priority must be an int (lower runs earlier), got {priority!r}")
    for attr in dir(type(callback)):
        if attr.startswith("on_") and attr not in EVENTS and callable(getattr(callback, attr)):
            close = difflib.get_close_matches(attr, EVENTS, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{name}.{attr} matches no seed-001 event, so it would never run.{hint} "
                f"The events are: {', '.join(EVENTS)}."
            )
