"""The plumbing every dialect shares, written once.

Each dialect recognises a callback by its ``on_*`` methods, refuses (or warns
about) a method that matches none of its events, orders callbacks by an int
``priority``, checkpoints those with ``state_dict``/``load_state_dict``, and
runs a dialect callback as one native callback that handles exactly the native
events it needs. The dialects differ only in their event names and messages.

>>> print(unknown_name("event", "on_ned", ("on_begin", "on_end")))
unknown event 'on_ned'. Did you mean 'on_end'? Valid events: on_begin, on_end.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from hookloop.callback import Callback
from hookloop.state import CallbackContext


# -- names ---------------------------------------------------------------------------
def did_you_mean(name: str, names: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``names``, or ``""``."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def unknown_name(
    what: str,
    name: object,
    names: Sequence[str],
    *,
    listed: str = "Valid events",
    first: str = "",
    last: str = "",
) -> str:
    """``unknown <what> <name>.<hint> <listed>: <names>.``

    The hint is ``first`` when given, else the closest name, else ``last``.
    """
    hint = ""
    if isinstance(name, str):
        hint = first or did_you_mean(name, names) or last
    return f"unknown {what} {name!r}.{hint} {listed}: {', '.join(names)}."


# -- hooks ---------------------------------------------------------------------------
def scan_hooks(
    obj: Any, events: Sequence[str], is_noop_base: Callable[[type], bool] = lambda k: False
) -> tuple[list[str], list[str]]:
    """``(handled, stray)``: the events ``obj`` handles, in the order of ``events``, and
    its other callable ``on_*`` attributes (a typo that would never run).

    A method defined by a class for which ``is_noop_base`` is true (the dialect's
    base class of empty hooks) counts as neither.
    """
    mro = type(obj).__mro__
    handled, stray = [], []
    for name in dir(obj):
        if not name.startswith("on_") or not callable(getattr(obj, name, None)):
            continue
        owner = next((k for k in mro if name in vars(k)), None)
        if owner is not None and is_noop_base(owner):
            continue
        (handled if name in events else stray).append(name)
    return sorted(handled, key=list(events).index), stray


def stray_message(owner: str, attr: str, events: Sequence[str], dialect: str = "") -> str:
    """What is said of ``owner.attr``, an ``on_*`` method no event of a dialect calls."""
    kind = f"{dialect} event" if dialect else "event"
    return (
        f"{owner}.{attr} matches no {kind}, so it would never run.{did_you_mean(attr, events)} "
        f"The events are: {', '.join(events)}."
    )


def check_priority(value: object, what: str) -> int:
    """``value`` if it is an int (not a bool); else ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int (lower runs earlier), got {value!r}")
    return value


def is_stateful(obj: object) -> bool:
    """Whether a checkpoint keeps ``obj``'s state (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def label(obj: object) -> str:
    """A callback's own non-empty ``name``, else its class name."""
    name = getattr(obj, "name", None)
    return name if isinstance(name, str) and name else type(obj).__name__


def as_list(callbacks: Any) -> list[Any]:
    """A ``callbacks`` argument as a list: None, one callback, or an iterable of them."""
    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes)):
        raise TypeError(f"callbacks must be callback objects, got the string {callbacks!r}")
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
        return [callbacks]  # one callback given on its own
    return list(callbacks)


# -- the adapter ---------------------------------------------------------------------
class DialectAdapter(Callback):
    """One dialect callback (``wrapped``), seen by the engine as a native callback.

    A dialect subclasses it and defines :meth:`dispatch`. The manager calls only
    the handlers a class overrides, so an adapter is built by :func:`adapt`, whose
    class has a handler for exactly the native events the wrapped callback needs:
    an event it ignores costs nothing, and ``describe_events()`` shows where it runs.
    A wrapped callback with ``state_dict``/``load_state_dict`` is checkpointed
    under the adapter's ``name``.
    """

    #: How a user gets one, for the message when the base class is called directly.
    built_by = "hookloop.compat._toolkit.adapt"

    def __init__(self, wrapped: Any) -> None:
        if "natives" not in vars(type(self)):
            raise TypeError(
                f"{type(self).__name__}(...) alone would handle no event; build it with "
                f"{self.built_by}"
            )
        self.wrapped = wrapped

    @property
    def name(self) -> str:
        return label(self.wrapped)

    def dispatch(self, native_event: str, ctx: CallbackContext) -> None:
        raise NotImplementedError


A = TypeVar("A", bound=DialectAdapter)


def adapt(base: type[A], wrapped: Any, natives: Iterable[str], *args: Any) -> A:
    """``base(wrapped, *args)`` as an instance of its subclass for ``natives``."""
    return adapter_class(base, frozenset(natives), is_stateful(wrapped))(wrapped, *args)


@functools.cache
def adapter_class(base: type[A], natives: frozenset[str], stateful: bool) -> type[A]:
    """The subclass of ``base`` handling exactly ``natives`` (made once per set)."""
    body: dict[str, Any] = {native: _relay(native) for native in sorted(natives)}
    body["natives"] = natives  # the native events it handles
    if stateful:
        body["state_dict"] = _state_dict
        body["load_state_dict"] = _load_state_dict
    return type(base.__name__, (base,), body)


def _relay(native: str) -> Callable[[DialectAdapter, CallbackContext], None]:
    def relay(self: DialectAdapter, ctx: CallbackContext) -> None:
        self.dispatch(native, ctx)

    relay.__name__ = relay.__qualname__ = native
    return relay


def _state_dict(self: DialectAdapter) -> dict[str, Any]:
    return self.wrapped.state_dict()


def _load_state_dict(self: DialectAdapter, state: dict[str, Any]) -> None:
    self.wrapped.load_state_dict(state)
