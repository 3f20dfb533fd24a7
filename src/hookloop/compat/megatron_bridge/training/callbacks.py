"""Megatron-Bridge's callback module: ``Callback``, ``CallbackContext``, ``CallbackManager``.

The names, shapes and behaviour are Megatron-Bridge's own
(``megatron.bridge.training.callbacks``): ``VALID_EVENTS`` is its frozenset of 14
event names, ``CallbackContext`` its dataclass, ``CallbackManager`` keeps one list
of callables per event and ``fire()`` calls them in registration order, letting
any exception through. ``normalize_callbacks`` and ``should_fire`` are its helpers.

What hookloop adds sits beside that, never instead of it: ``manager.native`` is the
native :class:`hookloop.CallbackManager` a Trainer fires; each event that has
callbacks is connected to it once (:mod:`.native_events`), so an event nobody
handles costs the loop nothing. ``docs/megatron-bridge.md`` lists where the dialect
differs on purpose.

>>> manager = CallbackManager()
>>> manager.register("on_train_start", lambda context: None)
>>> should_fire(manager, "on_train_start"), should_fire(manager, "on_train_end")
(True, False)
>>> manager.has_callbacks("no_such_event")
False
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hookloop.callback import Callback as NativeCallback
from hookloop.compat._toolkit import did_you_mean
from hookloop.events import EVENTS as NATIVE_EVENTS
from hookloop.manager import CallbackManager as NativeCallbackManager

if TYPE_CHECKING:
    from hookloop.compat.megatron_bridge.training.native_events import NativeEvents
    from hookloop.compat.megatron_bridge.training.state import GlobalState

logger: logging.Logger = logging.getLogger(__name__)

# Built in Megatron-Bridge's own order, so that the set prints the same in its error
# messages (a frozenset's order follows its insertions).
VALID_EVENTS: frozenset[str] = frozenset(
    {
        "on_data_init_start",
        "on_train_start",
        "on_train_step_start",
        "on_train_step_end",
        "on_train_end",
        "on_eval_start",
        "on_eval_step_start",
        "on_eval_step_end",
        "on_eval_end",
        "on_test_start",
        "on_test_step_start",
        "on_test_step_end",
        "on_test_end",
        "on_checkpoint_save",
    }
)

#: The same names in the order a run fires them (for listings and docs).
EVENT_NAMES: tuple[str, ...] = (
    "on_data_init_start",
    "on_train_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_eval_start",
    "on_eval_step_start",
    "on_eval_step_end",
    "on_eval_end",
    "on_checkpoint_save",
    "on_train_end",
    "on_test_start",
    "on_test_step_start",
    "on_test_step_end",
    "on_test_end",
)
EVENTS = VALID_EVENTS  # the name earlier hookloop releases exported


@dataclass
class CallbackContext:
    """What every callback receives; Megatron-Bridge builds a new one for each event.

    Always set: ``state`` (the run's :class:`GlobalState`), ``model`` (a list of model
    chunks; here one) and ``user_state`` (the manager's dict). Training events
    (``on_data_init_start``, ``on_train_*``) also carry ``optimizer`` and ``scheduler``;
    ``on_checkpoint_save`` the ``optimizer``. ``on_train_step_end`` adds ``loss_dict``
    (the step's reduced losses, 0-dim tensors keyed like the loss function's dict),
    ``grad_norm`` (a float, or None when clipping is off or the update was skipped)
    and ``skipped_iter``; ``on_eval_end``/``on_test_end`` add ``total_loss_dict``
    (averaged losses, tensors). The last two fields are hookloop's:
    ``non_loss_data`` (what ``non_loss_data_func`` returned, at eval/test end) and
    ``checkpoint_path`` (the directory ``on_checkpoint_save`` announces).
    """

    state: GlobalState
    model: list[Any]
    user_state: dict = field(default_factory=dict)
    optimizer: Any = None
    scheduler: Any = None
    loss_dict: dict[str, Any] | None = None
    grad_norm: float | None = None
    skipped_iter: bool | None = None
    total_loss_dict: dict[str, Any] | None = None
    non_loss_data: Any = None
    checkpoint_path: Any = None


class Callback:
    """Base class: override the ``on_*`` methods you need; the others are no-ops."""

    def on_data_init_start(self, context: CallbackContext) -> None:
        """Model, optimizer and checkpoint are ready; no dataset has been read yet."""

    def on_train_start(self, context: CallbackContext) -> None:
        """The model is in training mode; the first step has not begun."""

    def on_train_step_start(self, context: CallbackContext) -> None:
        """A step begins (``train_state.step`` counts the steps done before it)."""

    def on_train_step_end(self, context: CallbackContext) -> None:
        """A step's update is done (``train_state.step`` is still the step's index)."""

    def on_train_end(self, context: CallbackContext) -> None:
        """The loop finished its steps (not after an exit condition: that raises SystemExit)."""

    def on_eval_start(self, context: CallbackContext) -> None:
        """The model is in evaluation mode; the validation pass begins."""

    def on_eval_step_start(self, context: CallbackContext) -> None:
        """A validation batch begins."""

    def on_eval_step_end(self, context: CallbackContext) -> None:
        """A validation batch is done."""

    def on_eval_end(self, context: CallbackContext) -> None:
        """The validation pass is done (``total_loss_dict``), before training mode returns."""

    def on_test_start(self, context: CallbackContext) -> None:
        """The model is in evaluation mode; the test pass begins."""

    def on_test_step_start(self, context: CallbackContext) -> None:
        """A test batch begins."""

    def on_test_step_end(self, context: CallbackContext) -> None:
        """A test batch is done."""

    def on_test_end(self, context: CallbackContext) -> None:
        """The test pass is done (``total_loss_dict``)."""

    def on_checkpoint_save(self, context: CallbackContext) -> None:
        """A checkpoint was written."""


def _unknown_event(event_name: object) -> ValueError:
    """Megatron-Bridge's message, then hookloop's hint (closest name, or the native manager)."""
    hint = ""
    if isinstance(event_name, str):
        hint = did_you_mean(event_name, EVENT_NAMES)
        if not hint and event_name in NATIVE_EVENTS:
            hint = f" {event_name!r} is a native hookloop event: register it on manager.native."
    return ValueError(f"Unknown event '{event_name}'. Valid events: {VALID_EVENTS}{hint}")


class CallbackManager:
    """Callables per event, fired in registration order (``add`` and ``register`` alike).

    ``user_state`` is one dict every callback shares across events and runs.
    """

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable[[CallbackContext], None]]] = {
            event: [] for event in VALID_EVENTS
        }
        self._active_events: set[str] = set()
        self._user_state: dict = {}
        self._native: NativeEvents | None = None  # made when a loop first asks for it

    @property
    def user_state(self) -> dict:
        """The dict callbacks share (``context.user_state``)."""
        return self._user_state

    @property
    def events(self) -> frozenset[str]:
        """Every valid event name (``VALID_EVENTS``)."""
        return VALID_EVENTS

    def add(self, callback: Callback | list[Callback]) -> None:
        """Register the ``on_<event>`` methods each callback overrides, in order.

        A list adds each item. Methods inherited unchanged from :class:`Callback` are
        skipped; other ``on_*`` attributes are the callback's own business.
        """
        callbacks = list(callback) if isinstance(callback, (list, tuple)) else [callback]
        for cb in callbacks:
            _check_addable(cb)
        for cb in callbacks:
            for event_name in EVENT_NAMES:
                method = getattr(cb, event_name, None)
                if method is not None and getattr(method, "__func__", None) is not getattr(
                    Callback, event_name
                ):
                    self._append(event_name, method)
            _warn_near_misses(cb)

    def register(self, event_name: str, fn: Callable[[CallbackContext], None]) -> None:
        """Call ``fn(context)`` at every ``event_name`` (one of ``VALID_EVENTS``)."""
        if event_name not in VALID_EVENTS:
            raise _unknown_event(event_name)
        if not callable(fn):
            raise TypeError(
                f"register() needs a callable fn(context) for {event_name!r}, "
                f"got {type(fn).__name__}"
            )
        self._append(event_name, fn)

    def _append(self, event_name: str, fn: Callable[[CallbackContext], None]) -> None:
        self._callbacks[event_name].append(fn)
        self._active_events.add(event_name)
        if self._native is not None:
            self._native.connect(event_name)

    def list_callbacks(self, event_name: str) -> list[Callable[[CallbackContext], None]]:
        """A copy of the callables registered for ``event_name``, in execution order."""
        if event_name not in VALID_EVENTS:
            raise _unknown_event(event_name)
        return list(self._callbacks[event_name])

    def has_callbacks(self, event_name: str) -> bool:
        """Whether anything is registered for ``event_name`` (False for unknown names)."""
        return event_name in self._active_events

    def fire(self, event_name: str, context: CallbackContext) -> None:
        """Call every callable of ``event_name`` with ``context``; exceptions propagate."""
        for fn in self._callbacks[event_name]:
            fn(context)

    @property
    def native(self) -> NativeCallbackManager:
        """The native manager a :class:`hookloop.Trainer` fires (``callbacks=manager.native``).

        Native callbacks added to it run in the same loop and share ``user_state``.
        """
        if self._native is None:
            from hookloop.compat.megatron_bridge.training.native_events import NativeEvents

            self._native = NativeEvents(self, CallbackContext, EVENT_NAMES)
        return self._native.manager

    @property
    def native_events(self) -> NativeEvents:
        """The connection to the native loop (the entry points hand it the GlobalState)."""
        self.native  # noqa: B018 - made on first use
        assert self._native is not None
        return self._native

    def __repr__(self) -> str:
        counts = {e: len(fns) for e, fns in self._callbacks.items() if fns}
        return f"CallbackManager({counts})"


def normalize_callbacks(
    callbacks: list[Callback] | CallbackManager | None,
) -> CallbackManager | None:
    """``callbacks`` as a manager: None stays None, a manager is returned as is."""
    if callbacks is None:
        return None
    if isinstance(callbacks, CallbackManager):
        return callbacks
    if isinstance(callbacks, NativeCallbackManager):
        raise TypeError(
            "callbacks is a native hookloop.CallbackManager; pass a Megatron-Bridge "
            "CallbackManager or a list of its Callbacks (native callbacks go on manager.native)"
        )
    manager = CallbackManager()
    manager.add(callbacks)
    return manager


def should_fire(callback_manager: CallbackManager | None, event_name: str) -> bool:
    """Whether ``callback_manager`` exists and has callbacks for ``event_name``."""
    return callback_manager is not None and callback_manager.has_callbacks(event_name)


def as_manager(callbacks: CallbackManager | list[Callback] | Callback | None) -> CallbackManager:
    """The manager an entry point runs: ``callbacks`` normalized, or an empty one."""
    return normalize_callbacks(callbacks) or CallbackManager()


# -- what add() refuses, and what it only warns about -------------------------------


def _check_addable(cb: object) -> None:
    """Refuse what would silently do nothing or fail later: a class, a native
    callback, an object with no event method at all."""
    if isinstance(cb, type):
        raise TypeError(
            f"add() takes a callback instance, got the class {cb.__name__}; "
            f"write add({cb.__name__}())"
        )
    if isinstance(cb, NativeCallback):
        raise TypeError(
            f"{type(cb).__name__} is a native hookloop.Callback; add it to manager.native, "
            "or subclass hookloop.compat.megatron_bridge.training.callbacks.Callback"
        )
    if not isinstance(cb, Callback) and not any(
        callable(getattr(cb, event, None)) for event in EVENT_NAMES
    ):
        raise TypeError(
            f"add() takes a Callback (or any object with on_<event> methods) or a list of "
            f"them, got {type(cb).__name__}; to add a function use register(event_name, fn)"
        )


def _warn_near_misses(cb: object) -> None:
    """Log an ``on_*`` method one typo away from an event: Megatron-Bridge ignores it."""
    for attr in dir(type(cb)):
        if attr.startswith("on_") and attr not in VALID_EVENTS and attr not in NATIVE_EVENTS:
            hint = did_you_mean(attr, EVENT_NAMES)
            if hint:
                logger.warning(
                    "%s.%s matches no event and will never be called.%s",
                    type(cb).__name__,
                    attr,
                    hint,
                )
