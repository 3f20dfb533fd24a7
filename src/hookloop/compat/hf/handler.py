"""HF's callback plumbing: ``CallbackHandler``, the default callbacks, ``ExportableState``.

``CallbackHandler`` is the list ``trainer.callback_handler.callbacks`` that HF
code reads and edits (``add_callback`` / ``pop_callback`` / ``remove_callback``,
a warning for a second callback of one class). On the dialect Trainer every
edit also reaches the native callback manager, so the loop runs exactly the
listed callbacks. The handler also calls events directly (``on_push_begin``,
``call_event``), as HF's does.

``DefaultFlowCallback`` is HF's flow (:mod:`hookloop.compat.hf.flow`) as a
callback: first in the list, it sets the step's and the epoch's flags before
any user callback sees them; remove it and nothing is logged, evaluated or
saved on schedule, as in transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from hookloop.callback import Callback
from hookloop.compat.hf import flow
from hookloop.compat.hf.callback import TrainerCallback

# transformers' own logger: its verbosity settings (and log_level) govern these messages
logger = logging.getLogger("transformers.trainer_callback")


class DefaultFlowCallback(TrainerCallback):
    """Sets ``should_log`` / ``should_evaluate`` / ``should_save`` /
    ``should_training_stop`` from the ``TrainingArguments`` strategies."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        flow.flag_step_end(args, state, control)
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        flow.flag_epoch_end(args, state, control)
        return control


class PrinterCallback(TrainerCallback):
    """Prints each log on the main process after taking ``total_flos`` out of it (so the
    summary ``train()`` returns has none, as in transformers); HF's default with
    ``disable_tqdm``."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs is None:
            return
        logs.pop("total_flos", None)  # from the dict itself, as transformers' does
        if state.is_local_process_zero:
            print(logs)


class ExportableState:
    """A callback whose state a checkpoint keeps: ``state()`` returns
    ``{"args": constructor arguments, "attributes": attributes to set}``.

    >>> class Counter(TrainerCallback, ExportableState):
    ...     def __init__(self, start=0):
    ...         self.start, self.seen = start, 0
    ...     def state(self):
    ...         return {"args": {"start": self.start}, "attributes": {"seen": self.seen}}
    >>> Counter.from_state({"args": {"start": 5}, "attributes": {"seen": 2}}).seen
    2
    """

    def state(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define state() to be exported")

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Any:
        instance = cls(**state.get("args", {}))
        for name, value in state.get("attributes", {}).items():
            setattr(instance, name, value)
        return instance


def instance(callback: Any) -> Any:
    """``callback``, or an instance of it when it is an HF callback class (HF builds
    those without arguments); a native hookloop callback class is refused."""
    if not isinstance(callback, type):
        return callback
    if issubclass(callback, Callback):
        raise TypeError(
            f"callbacks takes instances; got the class {callback.__name__}, "
            f"write {callback.__name__}()"
        )
    return callback()


def is_exportable(cb: Any) -> bool:
    """transformers' ``ExportableState`` or ours (or any object with both methods)."""
    return callable(getattr(cb, "state", None)) and callable(getattr(cb, "from_state", None))


class CallbackHandler:
    """The ordered callbacks of one trainer, with HF's editing API and event calls."""

    def __init__(
        self,
        callbacks: Iterable[Any],
        model: Any = None,
        processing_class: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
    ) -> None:
        self.callbacks: list[Any] = []
        #: Told of each edit, ``listener("added" | "removed", callback)``: the dialect
        #: Trainer makes the same edit in the loop's callback manager.
        self.listener: Callable[[str, Any], None] | None = None
        for cb in callbacks:
            self.add_callback(cb)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader: Any = None
        self.eval_dataloader: Any = None
        if not any(type(cb).__name__ == "DefaultFlowCallback" for cb in self.callbacks):
            logger.warning(
                "The list of callbacks has no DefaultFlowCallback, so nothing is logged, "
                "evaluated or saved on the TrainingArguments' schedule; add one with "
                f"add_callback(DefaultFlowCallback). The callbacks are:\n{self.callback_list}"
            )

    # -- editing (the dialect Trainer mirrors each edit into the native manager) ----
    def add_callback(self, callback: Any) -> Any:
        """Add an instance, or a class (instantiated without arguments); returns it."""
        cb = instance(callback)
        if type(cb) in [type(c) for c in self.callbacks]:
            logger.warning(
                f"{type(cb).__name__} is added to the callbacks, but there is already one. "
                f"The callbacks are:\n{self.callback_list}"
            )
        self.callbacks.append(cb)
        if self.listener is not None:
            self.listener("added", cb)
        return cb

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return the first callback of a class, or that instance; None if absent."""
        for cb in self.callbacks:
            if isinstance(cb, callback) if isinstance(callback, type) else cb == callback:
                self.callbacks.remove(cb)
                if self.listener is not None:
                    self.listener("removed", cb)
                return cb
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove the first callback of a class, or that instance (which must be listed)."""
        if self.pop_callback(callback) is None and not isinstance(callback, type):
            raise ValueError(
                f"{callback!r} is not among the callbacks; they are: "
                + ", ".join(type(cb).__name__ for cb in self.callbacks)
            )

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    # -- calling events directly ---------------------------------------------------
    def call_event(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Call ``event`` on every listed HF-style callback, in order; returns the control."""
        for cb in self.callbacks:
            if isinstance(cb, Callback):
                continue  # a native callback: its handlers take the loop's ctx
            handler = getattr(cb, event, None)
            if handler is None or not callable(handler):
                continue
            result = handler(
                args,
                state,
                control,
                model=self.model,
                processing_class=self.processing_class,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader,
                **kwargs,
            )
            if result is not None and hasattr(result, "should_training_stop"):
                control = result
        return control

    # The events whose value transformers' handler takes as a fourth positional argument
    # (its Trainer calls ``on_log(args, state, control, logs)``, as do subclasses).
    def on_log(self, args: Any, state: Any, control: Any, logs: Any, **kwargs: Any) -> Any:
        return self._event("on_log", args, state, control, {"logs": logs, **kwargs})

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any, **kwargs: Any) -> Any:
        return self._event("on_evaluate", args, state, control, {"metrics": metrics, **kwargs})

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any, **kwargs: Any) -> Any:
        return self._event("on_predict", args, state, control, {"metrics": metrics, **kwargs})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):  # on_push_begin, on_log, ...: HF's resets, then the call
            return lambda args, state, control, **kw: self._event(name, args, state, control, kw)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _event(self, event: str, args: Any, state: Any, control: Any, kw: dict[str, Any]) -> Any:
        resets = _RESETS.get(event, ())
        for flag in resets:
            setattr(control, flag, False)
        return self.call_event(event, args, state, control, **kw)


#: The flags HF's handler clears before calling an event.
_RESETS = {
    "on_train_begin": ("should_training_stop",),
    "on_epoch_begin": ("should_epoch_stop",),
    "on_step_begin": ("should_log", "should_evaluate", "should_save"),
    "on_log": ("should_log",),
    "on_evaluate": ("should_evaluate",),
    "on_save": ("should_save",),
}

__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "ExportableState",
    "PrinterCallback",
    "instance",
    "is_exportable",
]
