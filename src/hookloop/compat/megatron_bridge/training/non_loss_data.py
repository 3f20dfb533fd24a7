"""Megatron's evaluation hooks for the dialect's ``pretrain`` / ``finetune``.

``non_loss_data_func(model)`` is computed at the end of each evaluation and of
the test phase (the native loop does that: ``ctx.non_loss_data`` during
``on_eval_end`` / ``on_test_end``), and
``process_non_loss_data_func(collected, iteration, writer)`` receives it with
the step and the run's TensorBoard writer, on the rank that holds the writer,
as Megatron's ``evaluate_and_print_results`` does. Megatron can also collect
the forward step's outputs when only the processing function is given;
hookloop asks for ``non_loss_data_func`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.manager import CallbackManager
from hookloop.state import CallbackContext


def check(non_loss_data_func: Any, process_non_loss_data_func: Any) -> None:
    """Both must be callables or None; processing needs something to process."""
    for name, fn in (
        ("non_loss_data_func", non_loss_data_func),
        ("process_non_loss_data_func", process_non_loss_data_func),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {fn!r}")
    if process_non_loss_data_func is not None and non_loss_data_func is None:
        raise ValueError(
            "process_non_loss_data_func needs non_loss_data_func(model) to compute what it "
            "processes (hookloop does not collect the forward step's outputs for it)"
        )


def register_processing(
    manager: CallbackManager,
    global_state: GlobalState,
    process: Callable[[Any, int, Any], Any] | None,
) -> None:
    """Call ``process(ctx.non_loss_data, step, tensorboard_writer)`` after each evaluation
    and after the test phase."""
    if process is None:
        return

    def after_evaluation(ctx: CallbackContext) -> None:
        writer = global_state.tensorboard_logger
        if writer is not None and ctx.non_loss_data is not None:
            process(ctx.non_loss_data, ctx.state.step, writer)

    manager.register("on_eval_end", after_evaluation)
    manager.register("on_test_end", after_evaluation)
