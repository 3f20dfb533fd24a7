"""Handlers for kinds of request added to the vocabulary after the built-in ones.

A new command that carries values (the control server's, say) is a kind
(:func:`hookloop.requests.register_kind`) and one handler here: the loop calls
``handler(trainer, values)`` at the end of the step the request was agreed at, on
every rank, before the step's log, whichever schedule runs (the native one or a
dialect's); to end training it files a stop (``trainer.control.request_stop``).

>>> from hookloop.requests import register_kind
>>> register_kind("note_example", "write a note into user_state")
>>> def note(trainer, values):
...     trainer.ctx.user_state["note"] = values["text"]
>>> register_action("note_example", note)
>>> handler_of("note_example") is note
True
>>> unregister_action("note_example")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hookloop.requests import BUILT_IN_KINDS, KINDS, check_kind

Handler = Callable[[Any, dict[str, Any]], Any]

_HANDLERS: dict[str, Handler] = {}


def register_action(kind: str, handler: Handler) -> None:
    """Let the loop act on requests of ``kind`` (a registered kind) with ``handler``."""
    check_kind(kind)
    if kind in BUILT_IN_KINDS:
        raise ValueError(f"request kind {kind!r} is the loop's own; register a new kind instead")
    if not callable(handler):
        raise TypeError(f"the handler of {kind!r} must be callable(trainer, values)")
    _HANDLERS[kind] = handler


def unregister_action(kind: str) -> None:
    """Forget the handler of ``kind`` and the kind itself (tests, plug-ins unloading)."""
    _HANDLERS.pop(kind, None)
    if kind not in BUILT_IN_KINDS:
        KINDS.pop(kind, None)


def handler_of(kind: str) -> Handler:
    """The handler registered for ``kind``; a ``KeyError`` naming the kind without one."""
    try:
        return _HANDLERS[kind]
    except KeyError:
        raise KeyError(
            f"no handler for requests of kind {kind!r}; register one with "
            "hookloop.loop.actions.register_action"
        ) from None
