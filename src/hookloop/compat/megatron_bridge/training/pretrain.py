"""``pretrain(config, forward_step_func, callbacks=...)`` in the seed's shape.

A thin layer over :func:`hookloop.entry.pretrain`: the callbacks (a list or a
dialect ``CallbackManager``) become native registrations, and the forward step
receives the run's :class:`GlobalState` as its first argument, the same object
the callbacks see as ``context.state``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hookloop import entry
from hookloop.compat.megatron_bridge.training.callbacks import (
    Callback,
    CallbackManager,
    as_manager,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.config import Config
from hookloop.state import TrainState
from hookloop.step import bind_forward_step
from hookloop.trainer import TrainResult

ForwardStepFunc = Callable[..., tuple[Any, Callable[..., Any]]]
Callbacks = CallbackManager | Iterable[Callback] | None


def pretrain(
    config: Config,
    forward_step_func: ForwardStepFunc,
    callbacks: Callbacks = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
) -> TrainResult:
    """Train ``config``'s recipe from scratch with ``forward_step_func``.

    ``forward_step_func(global_state, data_iterator, model, return_schedule_plan=False)``
    returns ``(output, loss_func)``. ``out_dir`` and ``resume`` are hookloop's
    (checkpoints under ``out_dir``; ``resume="auto"`` continues the newest one).
    """
    step, manager = prepare(config, forward_step_func, callbacks)
    return entry.pretrain(config, step, manager.native, out_dir=out_dir, resume=resume)


def prepare(
    config: Config, forward_step_func: ForwardStepFunc, callbacks: Callbacks
) -> tuple[Callable[[TrainState, Iterator[Any], Any], Any], CallbackManager]:
    """The native forward step and the dialect manager of one run, sharing one GlobalState."""
    if not isinstance(config, Config):
        raise TypeError(
            f"config must be a hookloop Config (e.g. from recipes.small_gpt_pretrain_config()), "
            f"got {type(config).__name__}"
        )
    if not callable(forward_step_func):
        raise TypeError(
            "forward_step_func must be callable as (global_state, data_iterator, model, "
            f"return_schedule_plan=False), got {type(forward_step_func).__name__}"
        )
    manager = as_manager(callbacks)
    global_state = GlobalState(config)
    manager.share_global_state(global_state)
    call = bind_forward_step(forward_step_func)  # also accepts (data_iterator, model)

    def forward_step(state: TrainState, data_iterator: Iterator[Any], model: Any) -> Any:
        global_state.attach(state)  # the loop's own counters, whichever trainer runs this
        return call(global_state, data_iterator, model)

    return forward_step, manager
