"""The native callback base class.

A callback is a class with ``on_<event>(self, ctx)`` methods. Only the methods a
subclass overrides are ever called: the manager skips the no-ops below when it
builds its event index, so an unhandled event costs nothing per handler.

Order is a number: ``priority`` (lower runs earlier, ties keep registration
order). The built-ins keep to the bands of :data:`PRIORITY_BANDS`; each one's own
priority is its class attribute. docs/callbacks.md's priority table is generated
from both by ``scripts/docs_reference.py``.

A callback with state worth resuming implements ``state_dict()`` and
``load_state_dict(state)``; its ``name`` is the key in the checkpoint.

An instance that has no use for one of its class's handlers (a constructor
argument made it pointless) sets it to ``None`` before it is registered, e.g.
``self.on_train_step_end = None``: that event then never calls it, as if the
class had not overridden it (like ``__hash__ = None`` in Python's data model).
Per-step events fire thousands of times, so this keeps a no-op off the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from hookloop.state import CallbackContext


#: The priority bands, lowest first: ``(first, last, what runs there)``; ``last`` is
#: ``None`` for the open-ended top band. The one copy: the docs are generated from it.
PRIORITY_BANDS: tuple[tuple[int, int | None, str], ...] = (
    (0, 19, "bookkeeping (NaN detection, optimizer mode, gradient capture)"),
    (20, 49, "metric producers (throughput, norms, memory)"),
    (50, 69, "user callbacks (the default is 50)"),
    (70, 89, "deciders (loss prediction, overfit, pruning, divergence)"),
    (90, 94, "stoppers (early stopping)"),
    (95, 99, "checkpoint policy"),
    (100, None, "loggers and progress output"),
)


@runtime_checkable
class Stateful(Protocol):
    """Anything whose state a checkpoint saves and restores."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Callback:
    """Base class for native callbacks: override the events you need."""

    #: Lower runs earlier; equal priorities keep registration order.
    priority: int = 50

    @property
    def name(self) -> str:
        """Key for this callback's state in checkpoints; the class name by default."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"

    # -- lifecycle ---------------------------------------------------------
    def on_init_end(self, ctx: CallbackContext) -> None: ...
    def on_data_init_start(self, ctx: CallbackContext) -> None: ...
    def on_train_start(self, ctx: CallbackContext) -> None: ...
    def on_epoch_start(self, ctx: CallbackContext) -> None: ...
    def on_train_step_start(self, ctx: CallbackContext) -> None: ...
    def on_micro_step_start(self, ctx: CallbackContext) -> None: ...
    def on_micro_step_end(self, ctx: CallbackContext) -> None: ...
    def on_before_optimizer_step(self, ctx: CallbackContext) -> None: ...
    def on_after_optimizer_step(self, ctx: CallbackContext) -> None: ...
    def on_train_step_end(self, ctx: CallbackContext) -> None: ...
    def on_before_log(self, ctx: CallbackContext) -> None: ...
    def on_log(self, ctx: CallbackContext) -> None: ...
    def on_eval_start(self, ctx: CallbackContext) -> None: ...
    def on_eval_step_start(self, ctx: CallbackContext) -> None: ...
    def on_eval_step_end(self, ctx: CallbackContext) -> None: ...
    def on_eval_end(self, ctx: CallbackContext) -> None: ...
    def on_test_start(self, ctx: CallbackContext) -> None: ...
    def on_test_step_start(self, ctx: CallbackContext) -> None: ...
    def on_test_step_end(self, ctx: CallbackContext) -> None: ...
    def on_test_end(self, ctx: CallbackContext) -> None: ...
    def on_epoch_end(self, ctx: CallbackContext) -> None: ...
    def on_checkpoint_save(self, ctx: CallbackContext) -> None: ...
    def on_checkpoint_load(self, ctx: CallbackContext) -> None: ...
    def on_exception(self, ctx: CallbackContext) -> None: ...
    def on_train_end(self, ctx: CallbackContext) -> None: ...
