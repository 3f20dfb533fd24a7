"""Megatron-Bridge's ``training.train``: its training loop over objects you built yourself.

``pretrain()``/``finetune()`` build everything from a config; :func:`train` is for code
that builds its own model, optimizer, scheduler and data iterators and calls
Megatron-Bridge's loop directly, with the design documents' signatures. It runs
hookloop's own loop (:mod:`.train_loop` builds it): each step skips a step listed in
``cfg.train.iterations_to_skip`` (reading its data), or fires ``on_train_step_start``,
steps, fires ``on_train_step_end`` and counts the step, its samples and FLOPs in
``global_state.train_state``; validates every ``cfg.train.eval_interval`` steps; runs
:func:`post_training_step_callbacks`; saves every ``cfg.checkpoint.save_interval``
steps; and stops on an exit condition (the exit signal, ``exit_duration_in_mins``
since ``state.start_time``, ``exit_interval``), saving first, then ends the process
with ``SystemExit`` and no ``on_train_end``, as Megatron-Bridge does. The loop's
requests (a stop, a save) are agreed across ranks, and its live settings apply.

The objects are plain torch ones: ``model`` is a list of one ``torch.nn.Module``
(several chunks are pipeline stages, which need Megatron-Core); ``optimizer`` a torch
optimizer, clipped by ``cfg.optimizer.clip_grad``; ``scheduler`` a torch LR scheduler,
one with Megatron's ``step(increment)``, or None; ``global_state`` the dialect's
:class:`GlobalState` of a :class:`ConfigContainer`. The other functions here are the
pieces Megatron-Bridge's own loop is made of, for code that calls them directly;
those that only act on Megatron-Core objects (forward pre-hooks, mxfp8 buffers) live
in :mod:`.megatron_core`, the progress-log ones in :mod:`.progress`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.compat.megatron_bridge.training.checkpointing import save_checkpoint
from hookloop.compat.megatron_bridge.training.megatron_core import (
    check_chunks,
    check_nvrx_straggler_detection,
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    should_disable_forward_pre_hook,
)
from hookloop.compat.megatron_bridge.training.megatron_core import (
    handle_mxfp8_param_buffer_copy as _handle_mxfp8_param_buffer_copy,
)
from hookloop.compat.megatron_bridge.training.native_events import exited
from hookloop.compat.megatron_bridge.training.native_step import megatron_stepper, run_step
from hookloop.compat.megatron_bridge.training.progress import (
    MegatronBridgeProgressLog,
    compute_throughputs_and_append_to_progress_log,
    get_start_time_from_progress_log,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.compat.megatron_bridge.training.train_loop import (
    MegatronStepWork,
    NonLossData,
    StepPlaceholders,
    build_trainer,
    post_training_step_callbacks,
)
from hookloop.compat.megatron_bridge.training.train_loop import (
    dummy_train_step as _dummy_train_step,
)
from hookloop.compat.megatron_bridge.training.train_support import (
    agreed,
    bind_step,
    check_train_inputs,
    manual_gc,
)
from hookloop.compat.megatron_bridge.training.utils.log_utils import barrier_and_log

__all__ = [
    "_dummy_train_step",
    "_finish_train",
    "_handle_mxfp8_param_buffer_copy",
    "_should_skip_and_handle_iteration",
    "checkpoint_and_decide_exit",
    "compute_throughputs_and_append_to_progress_log",
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "get_start_time_from_progress_log",
    "post_training_step_callbacks",
    "save_checkpoint_and_time",
    "should_disable_forward_pre_hook",
    "train",
    "train_step",
]

logger = logging.getLogger("megatron.bridge.training.train")

ForwardStepFunc = Callable[..., tuple[Any, Callable[[Any], Any]]]
DataIterator = Iterator[Any] | None
TrainStepResult = tuple[dict[str, torch.Tensor], int, bool, bool, int, float | None, int | None]


def train(
    forward_step_func: ForwardStepFunc,
    model: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    train_data_iterator: DataIterator,
    valid_data_iterator: DataIterator,
    global_state: GlobalState,
    checkpointing_context: dict[str, Any],
    process_non_loss_data_func: Callable[[Any, int, Any], Any] | None = None,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    *,
    callback_manager: CallbackManager | None = None,
) -> None:
    """Train until ``cfg.train.train_iters`` steps are done, or an exit condition holds.

    ``forward_step_func(global_state, data_iterator, model)`` (or ``(data_iterator,
    model)``) returns ``(output, loss_func)``. Validation runs on ``valid_data_iterator``
    every ``cfg.train.eval_interval`` steps when ``train_state.do_valid`` is set (it is
    set here when a valid iterator is given). ``callback_manager`` (Megatron-Bridge's
    newer keyword) receives the training, validation and checkpoint events. With
    ``cfg.train.exit_signal_handler`` the signal ``cfg.train.exit_signal`` (SIGTERM) is
    caught while training: the step finishes, the run saves and exits.
    """
    cfg = check_train_inputs(
        global_state, optimizer, checkpointing_context, callback_manager, model
    )
    non_loss_data = _check_non_loss_data(process_non_loss_data_func, non_loss_data_func)
    step_func = bind_step(forward_step_func, global_state)
    manager = callback_manager if callback_manager is not None else CallbackManager()
    manager.native_events.share(global_state)
    data = StepPlaceholders(global_state, train_data_iterator)
    trainer = build_trainer(global_state, step_func, model, optimizer, scheduler, data, manager)
    ts = global_state.train_state
    ts.do_train = True
    ts.do_valid = ts.do_valid or valid_data_iterator is not None
    global_state.job_start_flops = ts.floating_point_operations_so_far
    work = MegatronStepWork(
        global_state, model, step_func, valid_data_iterator, non_loss_data, manager
    )
    added: list[Any] = [work]
    if cfg.logger.log_progress:
        added.append(MegatronBridgeProgressLog(global_state, async_save=cfg.checkpoint.async_save))
    for callback in added:
        manager.native.add(callback)
    interval_time = global_state.timers("interval-time")
    interval_time.reset()  # a previous call that raised may have left it running
    interval_time.start()
    try:
        with manual_gc(cfg.train):
            result = trainer.train()
    finally:
        for callback in added:
            manager.native.remove(callback)
        if interval_time.active:
            interval_time.stop()
        global_state.refresh(trainer.state)
    _end(result.stop_reason, global_state)


def _end(stop_reason: str | None, state: GlobalState) -> None:
    """After the loop: the writer flushed; after an exit condition, the process ended."""
    writer = state.tensorboard_logger
    if writer is not None:
        writer.flush()
    if exited(stop_reason):
        barrier_and_log(_exit_message(stop_reason, state))
        _finish_train(state)
        sys.exit(0)


def _check_non_loss_data(process: Any, produce: Any) -> NonLossData:
    """``(process_non_loss_data_func, non_loss_data_func)``, each callable or None."""
    for name, fn in (("process_non_loss_data_func", process), ("non_loss_data_func", produce)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    return process, produce


def _exit_message(reason: str | None, state: GlobalState) -> str:
    """What Megatron-Bridge logs when an exit condition ends training."""
    if reason == "exit_duration":
        return f"exiting program after {(time.time() - state.start_time) / 60.0} minutes"
    if reason == "exit_interval":
        return f"exiting program at iteration {state.train_state.step}"
    if reason == "straggler":
        return "Exiting program due to straggler detection."
    return f"exiting program after receiving {(reason or '').partition(' ')[2]}."


def train_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: DataIterator,
    model: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    global_state: GlobalState,
) -> TrainStepResult:
    """One optimizer step over a global batch: forward and backward of each micro-batch,
    clipping, the update and the scheduler step.

    Returns ``(loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code,
    grad_norm, num_zeros_in_grad)``: the losses reduced over micro-batches (the loss
    function's keys); ``skipped_iter`` 1 when the gradients were not finite and the
    update was skipped, else 0; no checkpoint or exit is ever asked for here (those come
    from Megatron-Core's rerun machine); ``grad_norm`` a float when
    ``cfg.optimizer.clip_grad`` > 0, else None; ``num_zeros_in_grad`` None.
    """
    chunks = check_chunks(model)
    step_func = bind_step(forward_step_func, global_state)
    stepper = megatron_stepper(
        step_func, data_iterator, chunks[0], optimizer, scheduler, global_state
    )
    try:
        optimizer.zero_grad(set_to_none=True)  # as Megatron-Bridge, before the step
        loss_dict, skipped_iter, grad_norm = run_step(stepper)
    finally:
        stepper.release()
    return (loss_dict, skipped_iter, False, False, 0, grad_norm, None)


def save_checkpoint_and_time(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any],
    non_persistent_ckpt: bool = False,
    train_data_iterator: DataIterator = None,
    *,
    callback_manager: CallbackManager | None = None,
) -> None:
    """Save a checkpoint under the ``save-checkpoint`` timer (the ``interval-time``
    timer paused meanwhile), log the timer, and append the save's line to
    ``progress.txt`` when ``cfg.logger.log_progress``.

    ``non_persistent_ckpt=True`` (a node-local checkpoint) is refused: the dialect writes
    persistent checkpoints only. The data iterator's position is not saved.
    """
    if non_persistent_ckpt:
        raise ValueError(
            "non_persistent_ckpt=True asks for a node-local checkpoint, which training.train "
            "does not write; save persistent checkpoints (non_persistent_ckpt=False)"
        )
    timers = state.timers
    pause = timers("interval-time").active
    if pause:
        timers("interval-time").stop()
    with timers("save-checkpoint"):
        save_checkpoint(
            state,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            checkpointing_context,
            train_data_iterator=train_data_iterator,
            callback_manager=callback_manager,
        )
    timers.log(["save-checkpoint"])
    if getattr(state.cfg.logger, "log_progress", False):
        compute_throughputs_and_append_to_progress_log(state, num_floating_point_operations_so_far)
    if pause:
        timers("interval-time").start()


def checkpoint_and_decide_exit(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any],
    train_data_iterator: DataIterator,
    *,
    callback_manager: CallbackManager | None = None,
) -> bool:
    """Save when ``checkpoint.save_interval`` is due; say whether to stop.

    Stops, saving first (with ``checkpoint.save``, unless a save was just made), when
    any rank caught the exit signal (with ``train.exit_signal_handler``), when
    ``train.exit_duration_in_mins`` has passed since ``state.start_time``, or when the
    step is a multiple of ``train.exit_interval``. Returns True when the loop should exit.
    """
    cfg = state.cfg

    def save() -> None:
        save_checkpoint_and_time(
            state,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            checkpointing_context,
            train_data_iterator=train_data_iterator,
            callback_manager=callback_manager,
        )

    handler = state.signal_handler if cfg.train.exit_signal_handler else None
    if handler is not None and any(handler.signals_received()):
        if cfg.checkpoint.save:
            save()
        barrier_and_log("exiting program after receiving SIGTERM.")
        return True
    interval = cfg.checkpoint.save_interval
    saved = bool(cfg.checkpoint.save and interval and state.train_state.step % interval == 0)
    if saved:
        save()
    message = _exit_condition(state, model)
    if message is None:
        return False
    if cfg.checkpoint.save and not saved:
        save()
    barrier_and_log(message)
    return True


def _exit_condition(state: GlobalState, model: list[torch.nn.Module]) -> str | None:
    """What :func:`checkpoint_and_decide_exit` logs for the exit that holds (None: none):
    ``train.exit_duration_in_mins`` passed on any rank, ``train.exit_interval``, a straggler."""
    cfg, step = state.cfg, state.train_state.step
    minutes = cfg.train.exit_duration_in_mins
    train_time = (time.time() - state.start_time) / 60.0
    if minutes and agreed(train_time > minutes, model):
        return f"exiting program after {train_time} minutes"
    exit_interval = cfg.train.exit_interval
    if exit_interval and step % exit_interval == 0:
        return f"exiting program at iteration {step}"
    if check_nvrx_straggler_detection(state.nvrx_straggler_manager):
        return "Exiting program due to straggler detection."
    return None


def _finish_train(global_state: GlobalState) -> None:
    """Close the run: flush and close its TensorBoard writer, finish its W&B run."""
    global_state.close_loggers()


def _should_skip_and_handle_iteration(
    global_state: GlobalState, train_data_iterator: DataIterator
) -> bool:
    """When this step is in ``cfg.train.iterations_to_skip``: read its data without
    training (:func:`_dummy_train_step`), count the step and its samples as consumed and
    as skipped, and return True; else return False."""
    cfg = global_state.cfg
    ts = global_state.train_state
    if ts.step not in cfg.train.iterations_to_skip:
        return False
    _dummy_train_step(global_state, train_data_iterator)
    ts.step += 1
    ts.consumed_train_samples += cfg.train.global_batch_size
    ts.skipped_train_samples += cfg.train.global_batch_size
    return True
