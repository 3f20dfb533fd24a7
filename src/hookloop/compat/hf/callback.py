"""``TrainerCallback``: the base class of the HF dialect (transformers' Trainer, Forgather).

A handler is ``on_<event>(self, args, state, control, **kwargs)`` and may
return ``None`` or a control object; only the events a subclass overrides are
ever called. The event names are the dialect's column of
:mod:`hookloop.compat.mapping`. Handlers written as
``on_log_step(self, state, logs, **kwargs)`` (Forgather's form) work too: the
adapter passes ``args``, ``state`` and ``control`` by name to any handler whose
first three parameters are not exactly those.

kwargs always hold ``model``, ``processing_class``, ``optimizer``,
``lr_scheduler``, ``train_dataloader``, ``eval_dataloader`` and ``trainer``;
``on_log_step`` and ``on_log`` add ``logs`` (one mutable dict: what
``on_log_step`` adds, ``on_log`` sees); ``on_evaluate`` and ``on_predict`` add
``metrics``; ``on_train_metrics`` adds ``metrics`` with the step's losses,
``grad_norm`` and ``lr`` as floats.

>>> class Stopper(TrainerCallback):
...     def on_step_end(self, args, state, control, **kwargs):
...         if state.global_step >= 3:
...             control.should_training_stop = True
>>> Stopper().name
'Stopper'
"""

from __future__ import annotations

from typing import Any


class TrainerCallback:
    """Base class for HF-style callbacks: override the events you need."""

    @property
    def name(self) -> str:
        """A label for messages and for this callback's checkpoint state; the class name
        unless the callback sets its own ``self.name`` (HF callbacks may)."""
        return self.__dict__.get("_hookloop_name") or type(self).__name__

    @name.setter
    def name(self, value: str) -> None:
        self.__dict__["_hookloop_name"] = value

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_forward_backward_begin(
        self, args: Any, state: Any, control: Any, **kwargs: Any
    ) -> Any: ...
    def on_forward_backward_end(
        self, args: Any, state: Any, control: Any, **kwargs: Any
    ) -> Any: ...
    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_train_metrics(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_log_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any: ...
