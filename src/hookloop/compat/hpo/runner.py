"""``CallbackRunner``: the HPO trainer's list of callbacks, sorted by priority once, fired by name.

Use it standalone in a loop you write (``fire(event, trainer, **fields)``), or
hand its callbacks to a hookloop Trainer with :meth:`CallbackRunner.native`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hookloop.callback import Callback
from hookloop.compat._toolkit import check_priority
from hookloop.compat.hpo.adapter import adapt
from hookloop.compat.hpo.callback import (
    EVENTS,
    TrainingCallback,
    check_event,
    check_training_callback,
    overridden_hooks,
)
from hookloop.compat.hpo.direct import HpoHooks
from hookloop.compat.hpo.faces import face_for
from hookloop.manager import add_note

HpoCallbacks = Iterable[TrainingCallback | Callback]


class CallbackRunner:
    """Callbacks sorted by ``priority`` (lower first; ties keep list order), fired by event name.

    The list may mix HPO-trainer ``TrainingCallback`` objects and native hookloop
    callbacks (the nine HPO-trainer built-ins are native). ``fire`` drives the former
    and the nine built-ins (through their HPO-trainer faces, :mod:`hookloop.compat.hpo.faces`);
    inside a hookloop Trainer, :meth:`native` runs them all.
    """

    def __init__(self, callbacks: HpoCallbacks | None = None) -> None:
        if isinstance(callbacks, (TrainingCallback, Callback)):
            raise TypeError(
                f"CallbackRunner takes a list of callbacks, got a single "
                f"{type(callbacks).__name__}; write CallbackRunner([callback])"
            )
        if callbacks is None:
            callbacks = []
        if not isinstance(callbacks, Iterable) or isinstance(callbacks, (str, bytes)):
            raise TypeError(
                f"CallbackRunner takes a list of callbacks, got {type(callbacks).__name__}"
            )
        #: The callbacks in the order they run.
        self.callbacks: list[TrainingCallback | Callback] = []
        self._index(list(callbacks))

    def add(self, callback: TrainingCallback | Callback) -> None:
        """Add one callback; it runs in its place by priority (after equal ones already in)."""
        self._index([*self.callbacks, callback])

    def _index(self, items: list[TrainingCallback | Callback]) -> None:
        for item in items:
            _check_item(item)
        for i, item in enumerate(items):
            if any(other is item for other in items[:i]):
                raise ValueError(f"{item!r} is in the list twice; it would run twice per event")
        self.callbacks[:] = sorted(items, key=_priority)
        # The nine built-ins are native; fire() drives them through their HPO-trainer faces.
        self._faces = {id(cb): _face(cb, self.callbacks) for cb in self.callbacks}
        hpo_hooks = [
            cb if isinstance(cb, TrainingCallback) else self._faces[id(cb)] for cb in self.callbacks
        ]
        self._handlers = {
            event: tuple(
                getattr(cb, event)
                for cb in hpo_hooks
                if cb is not None and event in overridden_hooks(cb)
            )
            for event in EVENTS
        }

    def fire(self, event: str, trainer: Any, **fields: Any) -> None:
        """Call ``on_<event>(trainer, **fields)`` on every callback, in priority order.

        Other native callbacks than the nine HPO-trainer built-ins run only inside a
        hookloop Trainer: a runner holding one refuses to fire (``TypeError``).

        An exception from a hook propagates with a note naming the callback and event.
        """
        event = check_event(event)
        native = [
            cb for cb in self.callbacks if isinstance(cb, Callback) and self._faces[id(cb)] is None
        ]
        if native:
            names = ", ".join(type(cb).__name__ for cb in native)
            raise TypeError(
                f"fire() calls HPO-trainer hooks, but {names} are native hookloop callbacks, "
                "which run only inside a hookloop Trainer: pass runner.native() to "
                "Trainer(callbacks=...), or leave them out of a runner you fire yourself"
            )
        for hook in self._handlers[event]:
            try:
                hook(trainer, **fields)
            except Exception as exc:
                owner = type(getattr(hook.__self__, "native", hook.__self__)).__name__
                add_note(exc, f"hookloop.compat.hpo: raised by {owner}.{event}")
                raise

    @property
    def should_stop(self) -> bool:
        """Whether any callback has set ``should_stop`` or ``nan_detected``: stop the loop."""
        return any(
            getattr(cb, "should_stop", False) or getattr(cb, "nan_detected", False)
            for cb in self.callbacks
        )

    def native(self) -> list[Callback]:
        """The callbacks as native hookloop callbacks, for ``Trainer(callbacks=...)``.

        Each ``TrainingCallback`` becomes an :class:`HpoAdapter` with the same
        priority; native callbacks pass through unchanged. Each call makes new adapters.
        """
        return [cb if isinstance(cb, Callback) else adapt(cb) for cb in self.callbacks]

    def __iter__(self) -> Iterator[TrainingCallback | Callback]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def __repr__(self) -> str:
        return f"CallbackRunner({self.callbacks!r})"


def as_native(callbacks: CallbackRunner | TrainingCallback | HpoCallbacks) -> list[Callback]:
    """Native callbacks for a runner, one HPO-trainer callback, or a list (see ``native()``)."""
    if isinstance(callbacks, CallbackRunner):
        return callbacks.native()
    if isinstance(callbacks, (TrainingCallback, Callback)):
        callbacks = [callbacks]
    return CallbackRunner(callbacks).native()


def _check_item(item: object) -> None:
    if isinstance(item, type) and issubclass(item, (TrainingCallback, Callback)):
        raise TypeError(
            f"CallbackRunner takes callback instances, got the class {item.__name__}; "
            f"write {item.__name__}()"
        )
    if isinstance(item, TrainingCallback):
        check_training_callback(item)
    elif isinstance(item, Callback):
        check_priority(getattr(item, "priority", None), f"{type(item).__name__}.priority")
    else:
        raise TypeError(
            "CallbackRunner takes HPO-trainer TrainingCallback objects (or native hookloop "
            f"callbacks), got {type(item).__name__}: subclass "
            "hookloop.compat.hpo.TrainingCallback and override its on_* hooks"
        )


def _face(callback: TrainingCallback | Callback, peers: list[Any]) -> Any:
    """The HPO-trainer face of a native built-in (its own, shared with direct calls)."""
    if isinstance(callback, HpoHooks):
        return callback.hpo_face(peers)
    return face_for(callback, peers) if isinstance(callback, Callback) else None


def _priority(callback: TrainingCallback | Callback) -> int:
    return callback.priority
