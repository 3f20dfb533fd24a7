"""The HPO-trainer callback base: seven events, hooks ``(self, trainer, **fields)``, a priority.

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

from typing import Any

from hookloop.compat._toolkit import check_priority, scan_hooks, stray_message, unknown_name
from hookloop.compat.mapping import dialect_event_names, dialect_events

#: The HPO-trainer events, in firing order.
EVENTS: tuple[str, ...] = dialect_event_names("hpo")


class TrainingCallback:
    """Base class for HPO-trainer callbacks: override the hooks you need; the others do nothing.

    A hook receives the trainer, then fields that depend on the event, named and
    ordered as the HPO trainer's (inside a hookloop Trainer:
    :data:`hookloop.compat.hpo.FIELDS`). End every hook's signature with
    ``**kwargs`` so a field it does not name never breaks it.

    ``priority`` orders callbacks within an event: lower runs earlier, equal
    priorities keep their list order. The default, 50, is hookloop's band for
    user callbacks (after bookkeeping and metric producers, before deciders).
    Setting ``should_stop`` or ``nan_detected`` to True asks the trainer to stop.
    """

    #: Lower runs earlier; equal priorities keep list order.
    priority: int = 50

    def on_train_begin(self, trainer: Any, **kwargs: Any) -> None:
        """Once, before the first epoch."""

    def on_train_epoch_begin(self, trainer: Any, epoch: Any = None, **kwargs: Any) -> None:
        """At the start of each training epoch."""

    def on_train_step_end(
        self, trainer: Any, batch_idx: Any = None, loss: Any = None, **kwargs: Any
    ) -> None:
        """After each optimizer step."""

    def on_val_begin(self, trainer: Any, epoch: Any = None, **kwargs: Any) -> None:
        """Before each validation pass."""

    def on_val_end(
        self,
        trainer: Any,
        epoch: Any = None,
        val_loss: Any = None,
        metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        """After each validation pass, with its results."""

    def on_epoch_end(
        self,
        trainer: Any,
        epoch: Any = None,
        train_loss: Any = None,
        val_loss: Any = None,
        metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        """At the end of each epoch, after its validation."""

    def on_train_end(self, trainer: Any, **kwargs: Any) -> None:
        """Once, when training is over."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"


assert {n for n in vars(TrainingCallback) if n.startswith("on_")} == set(EVENTS)


def check_event(name: object) -> str:
    """``name`` if it is an HPO-trainer event; else a ``ValueError`` with a suggestion."""
    if isinstance(name, str) and name in EVENTS:
        return name
    raise ValueError(unknown_event_message(name))


def unknown_event_message(name: object) -> str:
    counterpart = dialect_events("hpo").get(name) if isinstance(name, str) else None
    native = (
        f" {name!r} is a native hookloop event; the HPO trainer calls it {counterpart[0]!r}."
        if counterpart
        else ""
    )
    return unknown_name("HPO-trainer event", name, EVENTS, listed="The events are", first=native)


def overridden_hooks(callback: TrainingCallback) -> frozenset[str]:
    """The events whose hook ``callback`` overrides (the base class's are no-ops)."""
    return frozenset(scan_hooks(callback, EVENTS, _is_base)[0])


def check_training_callback(callback: TrainingCallback) -> None:
    """Reject a non-int ``priority``, and ``on_*`` methods that match no event (typos never run)."""
    name = type(callback).__name__
    check_priority(getattr(callback, "priority", None), f"{name}.priority")
    stray = scan_hooks(callback, EVENTS, _is_base)[1]
    if stray:
        raise ValueError(stray_message(name, stray[0], EVENTS, "HPO-trainer"))


def _is_base(owner: type) -> bool:
    return owner is TrainingCallback
