"""The seed's callback API: ``Callback``, ``CallbackContext`` and ``CallbackManager``.

A dialect ``CallbackManager`` is a front for one native
:class:`hookloop.CallbackManager` (its ``native`` attribute). Every ``add()`` or
``register()`` is translated at once into native registrations, one per native
event that the callback handles, with the dispatch read from
:mod:`hookloop.compat.mapping`. So an event nobody handles costs nothing, order
follows the native rule (``priority``, then registration order), and an
exception from a dialect callback propagates with its name and event attached.

>>> manager = CallbackManager()
>>> manager.register("on_train_start", lambda context: print(context.state.train_state.step))
>>> manager.has_callbacks("on_train_start"), manager.has_callbacks("on_train_end")
(True, False)
>>> manager.native.has_callbacks("on_train_start")
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hookloop.callback import Callback as NativeCallback
from hookloop.compat._toolkit import check_priority, scan_hooks, stray_message, unknown_name
from hookloop.compat.mapping import dialect_event_names, dialect_events
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.events import EVENTS as NATIVE_EVENTS
from hookloop.manager import CallbackManager as NativeCallbackManager
from hookloop.state import CallbackContext as NativeContext

DIALECT = "megatron_bridge"

#: Every event name of this dialect, in native firing order.
EVENT_NAMES: tuple[str, ...] = dialect_event_names(DIALECT)
#: The same names as a set (``CallbackManager.events``).
EVENTS: frozenset[str] = frozenset(EVENT_NAMES)


class Callback:
    """Base class for seed-style callbacks: override the ``on_*`` methods you need.

    Each method receives one :class:`CallbackContext`. ``priority`` is a hookloop
    addition: lower runs earlier, also relative to native callbacks (default 50).
    """

    priority: int = 50

    def on_data_init_start(self, context: CallbackContext) -> None: ...
    def on_train_start(self, context: CallbackContext) -> None: ...
    def on_train_step_start(self, context: CallbackContext) -> None: ...
    def on_train_step_end(self, context: CallbackContext) -> None: ...
    def on_eval_start(self, context: CallbackContext) -> None: ...
    def on_eval_step_start(self, context: CallbackContext) -> None: ...
    def on_eval_step_end(self, context: CallbackContext) -> None: ...
    def on_eval_end(self, context: CallbackContext) -> None: ...
    def on_test_start(self, context: CallbackContext) -> None: ...
    def on_test_step_start(self, context: CallbackContext) -> None: ...
    def on_test_step_end(self, context: CallbackContext) -> None: ...
    def on_test_end(self, context: CallbackContext) -> None: ...
    def on_checkpoint_save(self, context: CallbackContext) -> None: ...
    def on_checkpoint_load(self, context: CallbackContext) -> None: ...
    def on_train_end(self, context: CallbackContext) -> None: ...


assert {n for n in vars(Callback) if n.startswith("on_")} == EVENTS, "Callback out of step"


class CallbackContext:
    """What a seed-style callback receives; fields carry the seed's names.

    Always set: ``state`` (a :class:`GlobalState`), ``model`` (a list of model
    chunks; here one), ``user_state`` (the manager's dict), ``optimizer``,
    ``scheduler``. Set during their events only, ``None`` otherwise:

    - ``loss_dict``, ``grad_norm``, ``skipped_iter`` (``on_train_step_end``): the
      step's reduced losses as 0-dim tensors (``"loss"`` plus every key of the
      loss function's meta dict, e.g. ``"lm loss"``), the gradient norm (a
      tensor, when clipping computed it) and whether the update was skipped;
    - ``total_loss_dict`` (``on_eval_end``, ``on_test_end``): the averaged
      losses as floats, keyed like ``loss_dict``;
    - ``checkpoint_path`` (``on_checkpoint_save``/``_load``, a hookloop addition);
    - ``non_loss_data`` (``on_eval_end``, ``on_test_end``): what ``pretrain``'s
      ``non_loss_data_func`` returned for this evaluation or test (seed 003's hook).
    """

    __slots__ = (
        "checkpoint_path",
        "grad_norm",
        "loss_dict",
        "model",
        "non_loss_data",
        "optimizer",
        "scheduler",
        "skipped_iter",
        "state",
        "total_loss_dict",
        "user_state",
    )

    def __init__(
        self,
        *,
        state: GlobalState | None = None,
        model: list[Any] | None = None,
        user_state: dict[str, Any] | None = None,
        optimizer: Any = None,
        scheduler: Any = None,
        loss_dict: dict[str, Any] | None = None,
        grad_norm: Any = None,
        skipped_iter: bool | None = None,
        total_loss_dict: dict[str, float] | None = None,
        checkpoint_path: Any = None,
    ) -> None:
        self.state = state
        self.model = model if model is not None else []
        self.user_state = user_state if user_state is not None else {}
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_dict = loss_dict
        self.grad_norm = grad_norm
        self.skipped_iter = skipped_iter
        self.total_loss_dict = total_loss_dict
        self.checkpoint_path = checkpoint_path
        self.non_loss_data: Any = None

    def _refresh(self, native: NativeContext) -> None:
        """Copy the per-event fields from the native context of the event being fired."""
        self.optimizer = native.optimizer
        self.scheduler = native.scheduler
        self.loss_dict = native.loss_dict
        self.grad_norm = native.grad_norm
        self.skipped_iter = native.skipped_iter
        metrics = native.metrics
        # Native keys carry the loop's prefix ("eval_loss", "test_lm loss"); the seed's don't.
        self.total_loss_dict = (
            None if metrics is None else {k.partition("_")[2]: v for k, v in metrics.items()}
        )
        self.checkpoint_path = native.checkpoint_path
        self.non_loss_data = native.non_loss_data

    def __repr__(self) -> str:
        return f"CallbackContext(state={self.state!r})"


class _Binding:
    """The dialect context of the run a manager is serving, rebuilt when the run changes."""

    __slots__ = ("context", "global_state", "native")

    def __init__(self) -> None:
        self.native: NativeContext | None = None
        self.context = CallbackContext()
        self.global_state: GlobalState | None = None

    def context_for(self, native: NativeContext, user_state: dict[str, Any]) -> CallbackContext:
        if native is not self.native:  # first event of a run (one trainer, one native context)
            state = self.global_state
            if state is None or state.native_config is not native.config:  # not pretrain's run
                state = GlobalState(native.config)
            state.attach(native.state)
            self.context = CallbackContext(state=state, model=[native.model], user_state=user_state)
            self.native = native
        # Each event's own state: a late on_checkpoint_save (checkpoint.async_save) carries
        # the state of the saved step, every other event the trainer's.
        self.context.state.attach(native.state)  # type: ignore[union-attr]
        self.context._refresh(native)
        return self.context


class CallbackManager:
    """Holds seed-style callbacks and functions; hands them to the loop as ``native``.

    Callbacks run in registration order (``add`` and ``register`` alike), unless
    a callback's ``priority`` says otherwise. ``user_state`` is one dict shared
    by every callback of every run this manager serves.
    """

    def __init__(self) -> None:
        #: The native manager the Trainer fires; add native callbacks here directly.
        self.native = NativeCallbackManager()
        self.user_state: dict[str, Any] = self.native.user_state
        # (dialect event, callable, priority) in registration order, for introspection.
        self._entries: list[tuple[str, Callable[[CallbackContext], Any], int]] = []
        self._callbacks: list[Callback] = []
        self._binding = _Binding()

    @property
    def events(self) -> frozenset[str]:
        """Every valid event name of this dialect."""
        return EVENTS

    def add(self, callback: Callback | Iterable[Callback]) -> None:
        """Add a :class:`Callback` instance, or a list of them, in order."""
        if isinstance(callback, Callback):
            self._add_one(callback)
        elif isinstance(callback, NativeCallback):
            raise TypeError(
                f"{type(callback).__name__} is a native hookloop.Callback; add it to "
                "manager.native, or subclass hookloop.compat.megatron_bridge.training."
                "callbacks.Callback"
            )
        elif isinstance(callback, type):
            raise TypeError(
                f"add() takes a callback instance, got the class {callback.__name__}; "
                f"write add({callback.__name__}())"
            )
        elif isinstance(callback, Iterable) and not isinstance(callback, (str, bytes, dict)):
            for item in list(callback):
                self.add(item)
        else:
            raise TypeError(
                f"add() takes a Callback or a list of them, got {type(callback).__name__}; "
                "to add a function use register(event_name, fn)"
            )

    def _add_one(self, callback: Callback) -> None:
        if any(existing is callback for existing in self._callbacks):
            raise ValueError(f"{callback!r} is already added to this manager")
        handled, stray = scan_hooks(callback, EVENT_NAMES, lambda owner: owner is Callback)
        if stray:  # a typo would otherwise never run
            raise ValueError(stray_message(type(callback).__name__, stray[0], EVENT_NAMES))
        priority = check_priority(callback.priority, f"{type(callback).__name__}.priority")
        for native_event, names in dialect_events(DIALECT).items():
            overridden = [n for n in names if n in handled]
            if overridden:
                self._connect(
                    native_event, [(n, getattr(callback, n)) for n in overridden], priority
                )
        self._callbacks.append(callback)

    def register(self, event_name: str, fn: Callable[[CallbackContext], Any]) -> None:
        """Call ``fn(context)`` at every ``event_name`` (one of :attr:`events`)."""
        _check_event(event_name)
        if not callable(fn):
            raise TypeError(
                f"register() needs a callable fn(context) for {event_name!r}, "
                f"got {type(fn).__name__}"
            )
        self._connect(_NATIVE_EVENT[event_name], [(event_name, fn)], priority=50)

    def _connect(
        self,
        native_event: str,
        calls: list[tuple[str, Callable[[CallbackContext], Any]]],
        priority: int,
    ) -> None:
        """One native registration that runs ``calls`` (in table order) with the dialect context."""
        binding, user_state = self._binding, self.user_state
        fns = tuple(fn for _, fn in calls)

        def handler(native: NativeContext) -> None:
            context = binding.context_for(native, user_state)
            for fn in fns:
                fn(context)

        # The native manager names this label when a call raises.
        handler.__qualname__ = " + ".join(_label(fn) for fn in fns)
        self.native.register(native_event, handler, priority=priority)
        self._entries.extend((event, fn, priority) for event, fn in calls)

    def share_global_state(self, state: GlobalState) -> None:
        """Give callbacks ``state`` (the one the forward step receives) from the next run on."""
        if not isinstance(state, GlobalState):
            raise TypeError(f"state must be a GlobalState, got {type(state).__name__}")
        self._binding.global_state = state
        self._binding.native = None  # rebuild the context at the next event

    def has_callbacks(self, event_name: str) -> bool:
        """Whether anything is registered for ``event_name``."""
        _check_event(event_name)
        return any(event == event_name for event, _, _ in self._entries)

    def list_callbacks(self, event_name: str) -> list[Callable[[CallbackContext], Any]]:
        """The bound methods and functions run at ``event_name``, in execution order."""
        _check_event(event_name)
        found = [(priority, fn) for event, fn, priority in self._entries if event == event_name]
        return [fn for _, fn in sorted(found, key=lambda pair: pair[0])]  # stable: ties keep order

    @property
    def callbacks(self) -> list[Callback]:
        """Callback instances in the order they were added."""
        return list(self._callbacks)

    def __repr__(self) -> str:
        return f"CallbackManager({len(self._callbacks)} callbacks, {len(self._entries)} handlers)"


def as_manager(
    callbacks: CallbackManager | Iterable[Callback] | Callback | None,
) -> CallbackManager:
    """The manager an entry point runs: ``callbacks`` itself, or a new one holding them."""
    if isinstance(callbacks, CallbackManager):
        return callbacks
    if isinstance(callbacks, NativeCallbackManager):
        raise TypeError(
            "callbacks is a native hookloop.CallbackManager; pass a megatron_bridge "
            "CallbackManager or a list of its Callbacks (native callbacks go on manager.native)"
        )
    manager = CallbackManager()
    if callbacks is None:
        return manager
    try:
        manager.add(callbacks)
    except TypeError as err:
        raise TypeError(
            "callbacks must be a list of megatron_bridge Callbacks or a megatron_bridge "
            f"CallbackManager: {err}"
        ) from None
    return manager


# -- helpers ---------------------------------------------------------------

#: dialect event -> the native event it is fired at (each has exactly one here).
_NATIVE_EVENT: dict[str, str] = {
    name: native for native, names in dialect_events(DIALECT).items() for name in names
}


def _label(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_event(name: object) -> None:
    if not (isinstance(name, str) and name in EVENTS):
        native = isinstance(name, str) and name in NATIVE_EVENTS
        hint = f" {name!r} is a native hookloop event: register it on manager.native."
        raise ValueError(unknown_name("event", name, EVENT_NAMES, last=hint if native else ""))
