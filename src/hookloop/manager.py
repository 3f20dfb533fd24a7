"""CallbackManager: registration, ordering, and dispatch of events.

Dispatch is precomputed. Whenever the set of callbacks changes, the manager
rebuilds one ``event -> list of bound handlers`` index, sorted by priority
(ties keep registration order) and leaving out every method a callback did not
override. Firing an event is then one dict lookup and a plain ``for`` loop over
that list, which costs what a loop over bound methods costs; an event nobody
handles returns at once.

A handler that adds or removes callbacks changes its own dispatch, as
transformers' CallbackHandler does: the rebuild *retires* each list whose handlers
changed (empties it, keeping what it held), which ends any loop running over it
after the current handler; the dispatch then goes on over the new list with the
handlers that have not run yet. Only a dispatch whose list changed pays for this.

Profiling (:meth:`CallbackManager.profile`) rebuilds the same index with each
handler wrapped in a timer, and switching it off rebuilds it bare: the
dispatch path never asks whether profiling is on.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, overload

from hookloop.callback import Callback, Stateful
from hookloop.events import (
    EPOCH_EVENTS,
    EVENT_NAMES,
    EVENTS,
    LIFECYCLE_EVENTS,
    STEP_EVENTS,
    check_event,
    unknown_event_message,
)
from hookloop.profile import CallbackProfile, publish
from hookloop.state import CallbackContext

Handler = Callable[[CallbackContext], Any]


class Handlers(list):  # type: ignore[type-arg]  # a list of Handler
    """One event's handlers in order. ``retired`` is what it held until the callbacks
    changed (it is then empty), or None while it is the live one."""

    __slots__ = ("retired",)

    def __init__(self, handlers: Iterable[Handler] = ()) -> None:
        super().__init__(handlers)
        self.retired: tuple[Handler, ...] | None = None


_BASE_METHODS = {name: getattr(Callback, name) for name in EVENT_NAMES}


class _Registration:
    """One handler of one event: who owns it, how it is called, where it sorts."""

    __slots__ = ("call", "event", "label", "owner", "priority", "seq")

    def __init__(
        self, owner: object, event: str, call: Handler, priority: int, seq: int, label: str
    ) -> None:
        self.owner = owner
        self.event = event
        self.call = call
        self.priority = priority
        self.seq = seq
        self.label = label


class CallbackManager:
    """Holds callbacks and fires events at them in priority order.

    >>> manager = CallbackManager()
    >>> _ = manager.register("on_train_start", lambda ctx: print("started"))
    >>> manager.fire("on_train_start", CallbackContext())
    started
    >>> manager.has_callbacks("on_train_end")
    False
    """

    def __init__(self, callbacks: Iterable[Callback] | Callback | None = None) -> None:
        self._registrations: list[_Registration] = []
        self._callbacks: list[Callback] = []
        self._seq = itertools.count()
        # The live index: every valid event is a key, unhandled ones map to an empty list.
        self._index: dict[str, Handlers] = {event: Handlers() for event in EVENT_NAMES}
        self._profile: CallbackProfile | None = None
        self.user_state: dict[str, Any] = {}
        if callbacks is not None:
            self.add(callbacks)

    # -- registration ------------------------------------------------------
    @property
    def events(self) -> frozenset[str]:
        """Every valid event name."""
        return EVENTS

    def add(
        self,
        callback: Callback | Iterable[Callback],
        *,
        every: int | None = None,
        once: bool | int | None = None,
        when: Callable[[CallbackContext], bool] | None = None,
    ) -> CallbackManager:
        """Add a callback (or a list of them).

        Filters apply to its handlers of every event except the set-up and
        tear-down ones (``on_train_start``, ``on_train_end``, ``on_exception`` …,
        see ``hookloop.events.LIFECYCLE_EVENTS``), which always run.
        """
        _check_filter_args(every, once, when)
        if isinstance(callback, Callback):
            self._add_one(callback, every, once, when)
        elif isinstance(callback, type) and issubclass(callback, Callback):
            raise TypeError(
                f"add() takes a callback instance, got the class {callback.__name__}; "
                f"write add({callback.__name__}())"
            )
        elif isinstance(callback, Iterable) and not isinstance(callback, (str, bytes)):
            for item in list(callback):
                self.add(item, every=every, once=once, when=when)
        else:
            raise TypeError(
                f"add() takes a hookloop.Callback or a list of them, got {type(callback).__name__}"
                "; to register a function use register(event, fn)"
            )
        return self

    def _add_one(
        self,
        cb: Callback,
        every: int | None,
        once: bool | int | None,
        when: Callable[[CallbackContext], bool] | None,
    ) -> None:
        if any(existing is cb for existing in self._callbacks):
            raise ValueError(f"callback {cb.name!r} is already registered with this manager")
        _check_method_names(cb)
        priority = _check_priority(getattr(cb, "priority", 50), f"{type(cb).__name__}.priority")
        if _is_stateful(cb):
            for other in self._callbacks:
                if _is_stateful(other) and other.name == cb.name:
                    raise ValueError(
                        f"two stateful callbacks are both named {cb.name!r}; their checkpoint "
                        "state would collide. Give them distinct names (override the `name` "
                        "property, e.g. return f'EarlyStopping[{self.monitor}]')."
                    )
        cls = type(cb)
        handled = [e for e in EVENT_NAMES if getattr(cls, e, None) is not _BASE_METHODS[e]]
        for event in handled:
            method = getattr(cb, event)
            if method is None:  # this instance opted out of the event (see hookloop.callback)
                continue
            call = (
                method if event in LIFECYCLE_EVENTS else _filtered(method, event, every, once, when)
            )
            self._registrations.append(
                _Registration(cb, event, call, priority, next(self._seq), cb.name)
            )
        self._callbacks.append(cb)
        self._rebuild()

    @overload
    def register(
        self,
        event: str,
        fn: None = None,
        *,
        every: int | None = None,
        once: bool | int | None = None,
        when: Callable[[CallbackContext], bool] | None = None,
        priority: int = 50,
    ) -> Callable[[Handler], Handler]: ...

    @overload
    def register(
        self,
        event: str,
        fn: Handler,
        *,
        every: int | None = None,
        once: bool | int | None = None,
        when: Callable[[CallbackContext], bool] | None = None,
        priority: int = 50,
    ) -> Handler: ...

    def register(
        self,
        event: str,
        fn: Handler | None = None,
        *,
        every: int | None = None,
        once: bool | int | None = None,
        when: Callable[[CallbackContext], bool] | None = None,
        priority: int = 50,
    ) -> Handler | Callable[[Handler], Handler]:
        """Register a function ``fn(ctx)`` for one event and return it.

        Without ``fn`` it returns a decorator: ``@manager.register("on_log")``.
        """
        event = check_event(event)
        if fn is None:
            return lambda f: self.register(
                event, f, every=every, once=once, when=when, priority=priority
            )
        if not callable(fn):
            raise TypeError(f"register() needs a callable fn(ctx), got {type(fn).__name__}")
        priority = _check_priority(priority, "priority")
        call = _filtered(fn, event, every, once, when)
        label = getattr(fn, "__qualname__", None) or repr(fn)
        self._registrations.append(_Registration(fn, event, call, priority, next(self._seq), label))
        self._rebuild()
        return fn

    def remove(self, callback_or_fn: object) -> None:
        """Remove a callback instance, or every registration of a function."""
        before = len(self._registrations)
        self._registrations = [r for r in self._registrations if r.owner is not callback_or_fn]
        was_callback = any(cb is callback_or_fn for cb in self._callbacks)
        self._callbacks = [cb for cb in self._callbacks if cb is not callback_or_fn]
        if len(self._registrations) == before and not was_callback:
            raise ValueError(f"{callback_or_fn!r} is not registered with this manager")
        self._rebuild()

    def _rebuild(self) -> None:
        ordered = sorted(self._registrations, key=lambda r: (r.priority, r.seq))
        fresh: dict[str, list[Handler]] = {e: [] for e in EVENT_NAMES}
        prof = self._profile
        for reg in ordered:
            call = reg.call if prof is None else prof.wrap(reg.seq, reg.label, reg.event, reg.call)
            fresh[reg.event].append(call)
        # Update in place: the Trainer keeps a reference to this very dict. A list whose
        # handlers changed is retired (emptied), which ends a dispatch running over it.
        for event, calls in fresh.items():
            old = self._index[event]
            if list.__eq__(old, calls):
                continue
            old.retired = tuple(old)
            old.clear()
            self._index[event] = Handlers(calls)

    # -- profiling ---------------------------------------------------------
    def profile(self, enabled: bool = True) -> CallbackProfile | None:
        """Measure every handler's calls and time per event, or (``False``) stop.

        Returns the running profile (or, when stopping, the one just stopped;
        None if none ran). Print ``profile.table()`` for the report. Handlers
        added while it runs are measured too.
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"profile() takes True (start) or False (stop), got {enabled!r}")
        if enabled:
            if self._profile is None:
                self._profile = CallbackProfile()
                self._rebuild()
                publish(self._profile)  # the control server serves it from there
            return self._profile
        stopped, self._profile = self._profile, None
        if stopped is not None:
            stopped.stop()
            self._rebuild()
            publish(None, replacing=stopped)
        return stopped

    @property
    def active_profile(self) -> CallbackProfile | None:
        """The profile being filled in, or None when profiling is off."""
        return self._profile

    # -- introspection -----------------------------------------------------
    @property
    def callbacks(self) -> list[Callback]:
        """Callback instances in the order they were added."""
        return list(self._callbacks)

    @property
    def index(self) -> dict[str, Handlers]:
        """The live event -> handlers mapping (read it, never modify it)."""
        return self._index

    def label_of(self, handler: object) -> str:
        """Who registered ``handler`` (a callback's name or a function's qualified name)."""
        return self._label_of(handler)

    def has_callbacks(self, event: str) -> bool:
        return bool(self._index[check_event(event)])

    def list_callbacks(self, event: str) -> list[object]:
        """The callbacks and functions that handle ``event``, in execution order."""
        event = check_event(event)
        return [r.owner for r in self._ordered(event)]

    def _ordered(self, event: str) -> list[_Registration]:
        regs = [r for r in self._registrations if r.event == event]
        return sorted(regs, key=lambda r: (r.priority, r.seq))

    def stateful_callbacks(self) -> dict[str, Stateful]:
        """Callbacks with ``state_dict``/``load_state_dict``, keyed by name."""
        return {
            cb.name: cb for cb in self._callbacks if isinstance(cb, Stateful) and _is_stateful(cb)
        }

    def check_requirements(self) -> None:
        """Raise if a callback's ``requires`` names a callback that is not registered."""
        names = {cb.name for cb in self._callbacks} | {type(cb).__name__ for cb in self._callbacks}
        for cb in self._callbacks:
            missing = [n for n in getattr(cb, "requires", ()) if n not in names]
            if missing:
                raise ValueError(
                    f"callback {cb.name!r} requires {', '.join(map(repr, missing))}, which "
                    "is not registered; add it to the same manager"
                )

    def describe_events(self, *, only_handled: bool = True, file: Any = None) -> str:
        """Print (and return) each event with its handlers in execution order."""
        lines = []
        for event in EVENT_NAMES:
            regs = self._ordered(event)
            if not regs and only_handled:
                continue
            lines.append(event)
            lines.extend(f"    {r.priority:>4}  {r.label}" for r in regs)
        text = "\n".join(lines) if lines else "(no handlers registered)"
        print(text, file=file if file is not None else sys.stdout)
        return text

    def __len__(self) -> int:
        return len({id(r.owner) for r in self._registrations} | {id(c) for c in self._callbacks})

    def __repr__(self) -> str:
        return f"CallbackManager({len(self)} callbacks)"

    # -- dispatch ----------------------------------------------------------
    def fire(self, event: str, ctx: CallbackContext) -> None:
        """Call every handler of ``event`` with ``ctx``, in priority order."""
        try:
            handlers = self._index[event]
        except (KeyError, TypeError):
            raise ValueError(unknown_event_message(event)) from None
        if not handlers:
            return
        handler: Handler | None = None
        try:
            for handler in handlers:
                handler(ctx)
            if handlers.retired is not None:  # a handler changed the callbacks
                self._go_on(event, ctx, handlers, handler)
        except Exception as exc:
            self._handler_failed(event, handler, ctx, exc)
            raise

    def _go_on(self, event: str, ctx: CallbackContext, ran: Handlers, last: object) -> None:
        """Finish a dispatch whose handlers changed while it ran: the handlers now
        registered that have not run yet (an added one runs now, a removed one does not)."""
        called: set[int] = set()
        handler: Handler | None = None
        while ran.retired is not None:
            before = ran.retired
            upto = next(i for i, h in enumerate(before) if h is last)
            called.update(_identity(h) for h in before[: upto + 1])
            ran = self._index[event]
            for handler in [h for h in ran if _identity(h) not in called]:
                try:
                    handler(ctx)
                except Exception as exc:
                    self._handler_failed(event, handler, ctx, exc)
                    raise
                last = handler
                if ran.retired is not None:
                    break
            else:
                return

    def _handler_failed(
        self, event: str, handler: object, ctx: CallbackContext, exc: Exception
    ) -> None:
        """Attach who failed and where, then give ``on_exception`` its one chance to run."""
        if getattr(exc, "_hookloop_attributed", False):
            return  # raised by a nested fire (e.g. an evaluation inside a step)
        label = self._label_of(handler)
        add_note(exc, f"hookloop: raised by callback {label!r} during event {event!r}")
        exc._hookloop_attributed = True  # type: ignore[attr-defined]  # a mark on the exception
        if event != "on_exception":
            self.fire_exception(ctx, exc)

    def _label_of(self, handler: object) -> str:
        """Who registered ``handler`` (also when it is a profiling wrapper)."""
        inner = getattr(handler, "__wrapped__", None)
        for r in self._registrations:
            if r.call is handler or (inner is not None and r.call is inner):
                return r.label
        return repr(handler)

    def fire_exception(self, ctx: CallbackContext, exc: BaseException) -> None:
        """Fire ``on_exception`` once per exception; a failing handler is noted, not raised."""
        if getattr(exc, "_hookloop_on_exception_fired", False):
            return
        exc._hookloop_on_exception_fired = True  # type: ignore[attr-defined]  # a mark on the exception
        ctx.exception = exc
        try:
            for handler in self._index["on_exception"]:
                try:
                    handler(ctx)
                except Exception as inner:
                    label = self._label_of(handler)
                    add_note(
                        exc,
                        f"hookloop: on_exception handler {label!r} also failed: "
                        f"{type(inner).__name__}: {inner}",
                    )
        finally:
            ctx.exception = None


# -- helpers ---------------------------------------------------------------


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (shown under its traceback), on Python 3.10 too."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: keep the note where 3.11+ would put it
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.11+ field


def _is_stateful(cb: object) -> bool:
    return callable(getattr(cb, "state_dict", None)) and callable(
        getattr(cb, "load_state_dict", None)
    )


def _check_priority(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int (lower runs earlier), got {value!r}")
    return value


def _check_method_names(cb: Callback) -> None:
    """Reject ``on_*`` methods that match no event: a typo would otherwise never run."""
    for attr in dir(type(cb)):
        if attr.startswith("on_") and attr not in EVENTS and callable(getattr(type(cb), attr)):
            raise ValueError(
                f"{type(cb).__name__}.{attr} matches no event, so it would never run: "
                + unknown_event_message(attr, what="callback method")
            )


def _check_filter_args(every: object, once: object, when: object) -> None:
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(
            f"every must be a positive int (run on every N-th occurrence), got {every!r}"
        )
    if (
        once is not None
        and once is not True
        and (isinstance(once, bool) or not isinstance(once, int) or once < 1)
    ):
        raise ValueError(
            f"once must be True (first occurrence only) or a positive int N (only the N-th), "
            f"got {once!r}"
        )
    if when is not None and not callable(when):
        raise ValueError(f"when must be a callable predicate when(ctx) -> bool, got {when!r}")


def _filtered(
    fn: Handler,
    event: str,
    every: int | None,
    once: bool | int | None,
    when: Callable[[CallbackContext], bool] | None,
) -> Handler:
    """Wrap ``fn`` so it runs only when the filters allow; unfiltered handlers stay bare.

    The occurrence counted by ``every`` / ``once=N`` is ``state.step`` for events
    inside a training step, the 1-based epoch for epoch events, and the number
    of times the event has fired otherwise. Counting steps (not calls) keeps the
    schedule right across a resume.
    """
    _check_filter_args(every, once, when)
    if every is None and once is None and when is None:
        return fn

    if event in STEP_EVENTS:

        def occurrence(ctx: CallbackContext) -> int:
            return int(ctx.state.step)
    elif event in EPOCH_EVENTS:

        def occurrence(ctx: CallbackContext) -> int:
            return int(ctx.state.epoch) + 1
    else:
        fired = itertools.count(1)

        def occurrence(ctx: CallbackContext) -> int:
            return next(fired)

    done = False

    def filtered(ctx: CallbackContext) -> None:
        nonlocal done
        n = occurrence(ctx)
        if every is not None and n % every:
            return
        if once is True and done:
            return
        if once is not None and once is not True and n != once:
            return
        if when is not None and not when(ctx):
            return
        done = True
        fn(ctx)

    filtered.__qualname__ = getattr(fn, "__qualname__", repr(fn))
    return filtered


def dispatch_in(frame: FrameType | None) -> tuple[str, str] | None:
    """``(event, callback)`` of the innermost dispatch running in ``frame``'s stack, or None.

    For a watchdog thread reading another thread's stack (``sys._current_frames()``): the
    hot path records nothing, the dispatch's own locals say where it is.
    """
    while frame is not None:
        if frame.f_code in _DISPATCH_CODES:
            names = frame.f_locals
            manager, handler = names.get("self"), names.get("handler")
            if isinstance(manager, CallbackManager) and handler is not None:
                return str(names.get("event")), manager.label_of(handler)
        frame = frame.f_back
    return None


_DISPATCH_CODES = (CallbackManager.fire.__code__, CallbackManager._go_on.__code__)


def _identity(handler: Handler) -> int:
    """Who a handler is across rebuilds of the index (a profiling wrapper is new each time)."""
    return id(getattr(handler, "__wrapped__", handler))
