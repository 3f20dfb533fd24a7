"""Megatron-Bridge events fired from hookloop's loop, with Megatron-Bridge's contexts.

A dialect :class:`~.callbacks.CallbackManager` gets one native manager; each event
that has callbacks is connected to it once, as one native handler that builds the
:class:`~.callbacks.CallbackContext` Megatron-Bridge would build at that point and
calls ``manager.fire``. Events nobody handles are never connected, so the loop pays
nothing for them.

Where the native loop and Megatron-Bridge disagree, the context follows Megatron-Bridge:

- ``train_state.step`` inside ``on_train_step_start``/``_end`` counts the steps done
  before this one (the native counter already counts it);
- ``loss_dict`` holds the loss function's own keys (no extra ``"loss"``), ``grad_norm``
  is a float (None when clipping is off or the update was skipped) and
  ``total_loss_dict`` holds tensors under unprefixed keys;
- eval and test events carry no optimizer or scheduler, ``on_checkpoint_save`` only
  the optimizer;
- ``on_train_end`` is not fired when an exit condition (``exit_interval``, the
  duration, a signal) ended training: Megatron-Bridge exits the process instead
  (``pretrain`` raises ``SystemExit(0)``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.native_step import users_scheduler
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.manager import CallbackManager as NativeCallbackManager
from hookloop.state import CallbackContext as NativeContext

#: Events that carry the optimizer and scheduler (Megatron-Bridge's training events).
TRAINING_EVENTS = frozenset(
    {
        "on_data_init_start",
        "on_train_start",
        "on_train_step_start",
        "on_train_step_end",
        "on_train_end",
    }
)
#: Events fired inside a step, where Megatron-Bridge's step counter has not moved yet.
STEP_EVENTS = frozenset({"on_train_step_start", "on_train_step_end"})


def exited(stop_reason: str | None) -> bool:
    """Whether training ended on an exit condition, after which Megatron-Bridge exits."""
    return stop_reason is not None and (
        stop_reason in ("exit_interval", "exit_duration", "straggler")
        or stop_reason.startswith("signal ")
    )


class NativeEvents:
    """The native manager serving one dialect manager, and the contexts it builds.

    ``dialect`` is the dialect's ``CallbackManager`` and ``context_type`` its
    ``CallbackContext`` (handed in, so this module does not import the callbacks module
    that makes it).
    """

    def __init__(self, dialect: Any, context_type: type, events: Iterable[str]) -> None:
        self.dialect = dialect
        self.context_type = context_type
        self.manager = NativeCallbackManager()
        self.manager.user_state = dialect.user_state
        self.global_state: GlobalState | None = None  # the entry point's, when it runs
        self._own_state: GlobalState | None = None  # for a Trainer run without one
        self._models: list[Any] = []
        self._connected: set[str] = set()
        for event in events:
            if dialect.has_callbacks(event):
                self.connect(event)

    def share(self, state: GlobalState) -> None:
        """Give callbacks ``state`` (the one the forward step receives) from now on."""
        if not isinstance(state, GlobalState):
            raise TypeError(f"state must be a GlobalState, got {type(state).__name__}")
        self.global_state = state

    def connect(self, event: str) -> None:
        """Fire ``event``'s dialect callbacks from the native event of that name (once)."""
        if event in self._connected:
            return
        self._connected.add(event)
        fire, build = self.dialect.fire, self.context

        if event == "on_train_end":

            def handler(ctx: NativeContext) -> None:
                if not exited(ctx.state.stop_reason):
                    fire(event, build(event, ctx))
        else:

            def handler(ctx: NativeContext) -> None:
                fire(event, build(event, ctx))

        handler.__qualname__ = f"Megatron-Bridge {event} callbacks"
        self.manager.register(event, handler)

    def state_for(self, ctx: NativeContext, *, in_step: bool) -> GlobalState:
        """The run's GlobalState, its ``train_state`` refreshed from the loop's counters."""
        state = self.global_state
        if state is None or state.native_config is not ctx.config:
            if self._own_state is None or self._own_state.native_config is not ctx.config:
                self._own_state = GlobalState(ctx.config)
            state = self._own_state
        state.refresh(
            ctx.state,
            in_step=in_step,
            # data the loop holds; training.train validates on its own iterator
            has_valid=ctx.run.has_eval_data or None,
            has_test=ctx.run.has_test_data or None,
        )
        return state

    def context(self, event: str, ctx: NativeContext) -> Any:
        """A new context for ``event``, with the fields Megatron-Bridge sets there."""
        context = self.context_type(
            state=self.state_for(ctx, in_step=event in STEP_EVENTS),
            model=self._model_list(ctx.model),
            user_state=self.dialect.user_state,
        )
        if event in TRAINING_EVENTS:
            context.optimizer, context.scheduler = ctx.optimizer, users_scheduler(ctx.scheduler)
        if event == "on_train_step_end":
            context.skipped_iter = bool(ctx.skipped_iter)
            context.loss_dict = _own_keys(ctx.loss_dict or {})
            norm = ctx.grad_norm
            context.grad_norm = None if norm is None or context.skipped_iter else float(norm)
        elif event in ("on_eval_end", "on_test_end"):
            metrics = {k.partition("_")[2]: v for k, v in (ctx.metrics or {}).items()}
            context.total_loss_dict = {k: torch.tensor(v) for k, v in _own_keys(metrics).items()}
            context.non_loss_data = ctx.non_loss_data
        elif event == "on_checkpoint_save":
            context.optimizer, context.checkpoint_path = ctx.optimizer, ctx.checkpoint_path
        return context

    def _model_list(self, model: Any) -> list[Any]:
        """One list per model, as Megatron-Bridge passes the same list at every event."""
        if not self._models or self._models[0] is not model:
            self._models = [model]
        return self._models


def _own_keys(losses: dict[str, Any]) -> dict[str, Any]:
    """The loss function's keys: the loop's own ``"loss"`` only when it is the only one."""
    own = {k: v for k, v in losses.items() if k != "loss"}
    return own or dict(losses)
