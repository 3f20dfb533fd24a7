"""Forgather's callbacks called the way transformers calls a ``TrainerCallback``.

A Forgather callback answers transformers' events, ``cb.on_step_end(args, state,
control, **kwargs)``: transformers' ``CallbackHandler`` calls every event on every
callback, and tests and hand-written loops call them directly. Several of
hookloop's Forgather callbacks are native hookloop callbacks (their hooks take
one ``CallbackContext``); :func:`answers_transformers_events` gives such a class
every event method of transformers and Forgather besides:

>>> from types import SimpleNamespace
>>> from hookloop.compat.forgather import InfoCallback
>>> control = SimpleNamespace(should_training_stop=False)
>>> InfoCallback().on_step_end(None, None, control) is None
True

Called that way, an event runs the class's ``hf_<event>(args, state, control,
**kwargs)`` method when it has one (``DivergenceDetector.hf_on_log``), and otherwise
does nothing and returns None, as transformers' base class does. Four event names
are also hookloop events (``on_init_end``, ``on_epoch_end``, ``on_log``,
``on_train_end``): called with one ``CallbackContext`` they run the native hook.
The other names are looked up through ``__getattr__``, so a hookloop Trainer (which
refuses a method named after none of its events) never sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hookloop.callback import Callback
from hookloop.compat.hf.callback import TrainerCallback
from hookloop.events import EVENT_NAMES
from hookloop.state import CallbackContext

#: transformers' events and Forgather's (``on_log_step``, ``on_train_metrics``,
#: ``on_forward_backward_begin`` / ``_end``), each called as ``(args, state, control, **kwargs)``.
EVENTS: tuple[str, ...] = (
    *(name for name in vars(TrainerCallback) if name.startswith("on_")),
    "on_push_begin",
)

#: The event names that are hookloop events too: the method answers both kinds of call.
SHARED = tuple(name for name in EVENTS if name in EVENT_NAMES)

C = TypeVar("C", bound=type)


def answers_transformers_events(cls: C) -> C:
    """Give ``cls`` every event method of :data:`EVENTS` for calls made the transformers way."""
    if issubclass(cls, Callback):
        for name in SHARED:
            setattr(cls, name, _shared_event(name, getattr(cls, name)))
    cls.__getattr__ = _event_lookup  # type: ignore[attr-defined]  # added to any class
    return cls


def _shared_event(name: str, native: Callable[..., Any]) -> Callable[..., Any]:
    def event(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], CallbackContext):
            return native(self, args[0])
        return _transformers_call(self, name)(*args, **kwargs)

    event.__name__ = event.__qualname__ = name
    event.__doc__ = (
        f"hookloop's {name}(ctx), or transformers' {name}(args, state, control, **kwargs)."
    )
    return event


def _event_lookup(self: Any, name: str) -> Any:
    if name in EVENTS:
        return _transformers_call(self, name)
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _transformers_call(callback: Any, name: str) -> Callable[..., Any]:
    handler = getattr(type(callback), f"hf_{name}", None)
    if handler is not None:
        return handler.__get__(callback)
    return _nothing


def _nothing(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
    """An event the callback has no use for, as transformers' base class: nothing, None."""
