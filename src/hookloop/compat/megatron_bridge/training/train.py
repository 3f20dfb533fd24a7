"""Megatron-Bridge's ``training.train``: its training loop over objects you built yourself.

``pretrain()``/``finetune()`` build everything from a config and run hookloop's loop;
:func:`train` is for code that builds its own model, optimizer, scheduler and data
iterators and calls Megatron-Bridge's loop directly, with the design documents'
signatures. The loop is Megatron-Bridge's: each iteration skips a step listed in
``cfg.train.iterations_to_skip`` (reading its data), or fires ``on_train_step_start``,
runs :func:`train_step`, fires ``on_train_step_end`` and counts the step, its samples
and FLOPs in ``global_state.train_state``; validates every ``cfg.train.eval_interval``
steps; runs :func:`post_training_step_callbacks`; saves and decides whether to exit
(:func:`checkpoint_and_decide_exit`). An exit condition ends the process with
``SystemExit`` and no ``on_train_end``, as in Megatron-Bridge.

The objects are plain torch ones: ``model`` is a list of one ``torch.nn.Module``
(several chunks are pipeline stages, which need Megatron-Core); ``optimizer`` a torch
optimizer, clipped by ``cfg.optimizer.clip_grad``; ``scheduler`` a torch LR scheduler
(or None); ``global_state`` the dialect's :class:`GlobalState` of a
:class:`ConfigContainer`. The functions that only act on Megatron-Core objects
(forward pre-hooks, mxfp8 buffers) live in :mod:`.megatron_core`; the progress-log
ones in :mod:`.progress`; both are importable from here under Megatron-Bridge's names.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.callbacks import (
    CallbackContext,
    CallbackManager,
    should_fire,
)
from hookloop.compat.megatron_bridge.training.checkpointing import save_checkpoint
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.eval import evaluate_and_print_results
from hookloop.compat.megatron_bridge.training.forward_backward import (
    forward_backward,
    num_microbatches,
    reduce_loss_dicts,
)
from hookloop.compat.megatron_bridge.training.megatron_core import (
    check_chunks,
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    should_disable_forward_pre_hook,
)
from hookloop.compat.megatron_bridge.training.megatron_core import (
    handle_mxfp8_param_buffer_copy as _handle_mxfp8_param_buffer_copy,
)
from hookloop.compat.megatron_bridge.training.progress import (
    compute_throughputs_and_append_to_progress_log,
    get_start_time_from_progress_log,
    log_job_start,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.distributed import rank_info
from hookloop.recipes.gpt import flops_per_sample
from hookloop.step import bind_forward_step

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
    newer keyword) receives the training, validation and checkpoint events.
    """
    cfg = _check_train_inputs(
        global_state, optimizer, checkpointing_context, callback_manager, model
    )
    for name, fn in (
        ("process_non_loss_data_func", process_non_loss_data_func),
        ("non_loss_data_func", non_loss_data_func),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    step_func = _bind(forward_step_func, global_state)
    ts, train_cfg = global_state.train_state, cfg.train
    ts.do_train = True
    ts.do_valid = ts.do_valid or valid_data_iterator is not None
    global_state.job_start_flops = ts.floating_point_operations_so_far
    if cfg.logger.log_progress:
        log_job_start(global_state)
    flops_per_batch = train_cfg.global_batch_size * flops_per_sample(
        cfg.gpt_config(), sum(p.numel() for p in model[0].parameters())
    )
    for chunk in model:
        chunk.train()
    interval_time = global_state.timers("interval-time")
    interval_time.reset()  # a previous call that raised may have left it running
    interval_time.start()
    _fire(callback_manager, "on_train_start", global_state, model, optimizer, scheduler)

    flops_since_log, should_exit, exit_code = 0.0, False, 0
    while ts.step < train_cfg.train_iters:
        if _should_skip_and_handle_iteration(global_state, train_data_iterator):
            continue
        _fire(callback_manager, "on_train_step_start", global_state, model, optimizer, scheduler)
        loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, _ = (
            train_step(step_func, train_data_iterator, model, optimizer, scheduler, global_state)
        )
        if should_fire(callback_manager, "on_train_step_end"):
            assert callback_manager is not None
            context = _context(callback_manager, global_state, model, optimizer, scheduler)
            context.loss_dict, context.grad_norm = loss_dict, grad_norm
            context.skipped_iter = bool(skipped_iter)
            callback_manager.fire("on_train_step_end", context)
        if should_checkpoint:
            save_checkpoint_and_time(
                global_state,
                model,
                optimizer,
                scheduler,
                ts.floating_point_operations_so_far,
                checkpointing_context,
                callback_manager=callback_manager,
            )
        if should_exit:
            break
        ts.step += 1
        ts.consumed_train_samples += train_cfg.global_batch_size
        ts.floating_point_operations_so_far += flops_per_batch
        flops_since_log += flops_per_batch
        _log_step(global_state, loss_dict, grad_norm, optimizer)
        interval = train_cfg.eval_interval
        if ts.do_valid and interval and ts.step % interval == 0:
            interval_time.stop()
            evaluate_and_print_results(
                global_state,
                f"iteration {ts.step}",
                step_func,
                valid_data_iterator,
                model,
                process_non_loss_data_func=process_non_loss_data_func,
                non_loss_data_func=non_loss_data_func,
                callback_manager=callback_manager,
            )
            interval_time.start()
        post_training_step_callbacks(model, flops_since_log, None, ts.step, None, cfg, False, None)
        should_exit = checkpoint_and_decide_exit(
            global_state,
            model,
            optimizer,
            scheduler,
            ts.floating_point_operations_so_far,
            checkpointing_context,
            train_data_iterator,
            callback_manager=callback_manager,
        )
        if should_exit:
            break

    interval_time.stop()
    writer = global_state.tensorboard_logger
    if writer is not None:
        writer.flush()
    if should_exit:
        _finish_train(global_state)
        sys.exit(exit_code)
    _fire(callback_manager, "on_train_end", global_state, model, optimizer, scheduler)


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
    cfg = global_state.cfg
    chunks = check_chunks(model)
    step_func = _bind(forward_step_func, global_state)
    count = num_microbatches(
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        data_parallel_size=rank_info()[2],
    )
    optimizer.zero_grad(set_to_none=True)
    timers = global_state.timers
    with timers("forward-backward"):
        loss_dicts = forward_backward(
            step_func,
            data_iterator,
            chunks[0],
            count,
            forward_only=False,
            what="train_data_iterator",
        )
    with timers("optimizer"):
        update_successful, grad_norm = _optimizer_step(optimizer, chunks, cfg.optimizer.clip_grad)
    if update_successful and scheduler is not None:
        scheduler.step()
    return (
        reduce_loss_dicts(loss_dicts),
        0 if update_successful else 1,
        False,
        False,
        0,
        grad_norm,
        None,
    )


def post_training_step_callbacks(
    model: list[torch.nn.Module],
    num_floating_point_operations_since_last_log_event: float,
    straggler_timer: Any,
    iteration: int,
    prof: torch.profiler.profile | None,
    config: Any,
    should_toggle_forward_pre_hook: bool,
    nsys_nvtx_context: Any = None,
) -> None:
    """What runs after each step: a CUDA sync every ``train.train_sync_interval`` steps,
    the straggler report every ``logger.log_interval`` steps (with a ``straggler_timer``
    and ``config.straggler.log_straggler``), one profiler step, and a garbage collection
    every ``train.manual_gc_interval`` steps with ``train.manual_gc``. Settings the
    config does not have are off; ``nsys_nvtx_context`` (Nsight ranges) is not used.
    """
    check_chunks(model)
    train_cfg = getattr(config, "train", None)
    sync_interval = getattr(train_cfg, "train_sync_interval", None)
    if sync_interval and iteration % sync_interval == 0 and torch.cuda.is_available():
        torch.cuda.synchronize()
    straggler = getattr(config, "straggler", None)
    log_interval = getattr(getattr(config, "logger", None), "log_interval", 0)
    if (
        straggler_timer is not None
        and getattr(straggler, "log_straggler", False)
        and log_interval
        and iteration % log_interval == 0
    ):
        straggler_timer.report(num_floating_point_operations_since_last_log_event, log_interval)
    if prof is not None:
        prof.step()
    gc_interval = getattr(train_cfg, "manual_gc_interval", 0)
    if getattr(train_cfg, "manual_gc", False) and gc_interval and iteration % gc_interval == 0:
        gc.collect()


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
            checkpointing_context,
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

    Stops (after a save, unless one was just made) when ``train.exit_duration_in_mins``
    has passed since ``state.start_time`` or the step is a multiple of
    ``train.exit_interval``. Returns True when the loop should exit.
    """
    cfg = state.cfg
    step = state.train_state.step

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

    saved = False
    interval = cfg.checkpoint.save_interval
    if cfg.checkpoint.save and interval and step % interval == 0:
        save()
        saved = True
    minutes = cfg.train.exit_duration_in_mins
    if minutes and _agreed((time.time() - state.start_time) / 60.0 > minutes):
        if cfg.checkpoint.save and not saved:
            save()
        logger.info("exiting program after %s minutes", minutes)
        return True
    exit_interval = cfg.train.exit_interval
    if exit_interval and step % exit_interval == 0:
        if cfg.checkpoint.save and not saved:
            save()
        logger.info("exiting program at iteration %d", step)
        return True
    return False


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


def _dummy_train_step(global_state: GlobalState, train_data_iterator: DataIterator) -> None:
    """Draw one step's micro-batches from ``train_data_iterator`` and drop them."""
    if train_data_iterator is None:
        return
    cfg = global_state.cfg.train
    count = num_microbatches(
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        data_parallel_size=rank_info()[2],
    )
    for index in range(count):
        try:
            next(train_data_iterator)
        except StopIteration:
            raise RuntimeError(
                f"train_data_iterator ran out of data while skipping step "
                f"{global_state.train_state.step} (micro-batch {index + 1} of {count})"
            ) from None


# -- helpers


def _check_train_inputs(
    global_state: Any,
    optimizer: Any,
    checkpointing_context: Any,
    callback_manager: Any,
    model: Any,
) -> ConfigContainer:
    """The run's ConfigContainer, once every argument is of a kind the loop can drive."""
    if not isinstance(global_state, GlobalState):
        raise TypeError(f"global_state must be a GlobalState, got {type(global_state).__name__}")
    cfg = global_state.cfg
    if not isinstance(cfg, ConfigContainer):
        raise TypeError(
            "global_state.cfg must be a ConfigContainer (e.g. "
            f"recipes.tiny_gpt_pretrain_config()), got {type(cfg).__name__}"
        )
    cfg.validate(rank_info()[2])
    if len(check_chunks(model)) != 1:
        raise ValueError(
            f"model has {len(model)} chunks; training.train drives one (several chunks are "
            "pipeline stages, which need Megatron-Core)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch optimizer, got {type(optimizer).__name__}")
    if not isinstance(checkpointing_context, dict):
        raise TypeError(
            "checkpointing_context must be a dict (start with {}), got "
            f"{type(checkpointing_context).__name__}"
        )
    if callback_manager is not None and not isinstance(callback_manager, CallbackManager):
        raise TypeError(
            "callback_manager must be a CallbackManager or None, got "
            f"{type(callback_manager).__name__}"
        )
    return cfg


def _bind(forward_step_func: ForwardStepFunc, global_state: GlobalState) -> Callable[..., Any]:
    """``forward_step_func`` as ``(data_iterator, model)``, the state bound when it takes it."""
    if not callable(forward_step_func):
        raise TypeError(
            "forward_step_func must be callable as (global_state, data_iterator, model) or "
            f"(data_iterator, model), got {type(forward_step_func).__name__}"
        )
    return functools.partial(bind_forward_step(forward_step_func), global_state)


def _optimizer_step(
    optimizer: torch.optim.Optimizer, model: list[torch.nn.Module], clip_grad: float
) -> tuple[bool, float | None]:
    """Clip (when ``clip_grad`` > 0) and step; skip the update when the norm is not finite."""
    grad_norm = None
    if clip_grad > 0:
        params = [p for chunk in model for p in chunk.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip_grad))
        if not torch.isfinite(torch.tensor(norm)):
            return False, None
        grad_norm = norm
    optimizer.step()
    return True, grad_norm


def _agreed(flag: bool) -> bool:
    """``flag`` agreed over ranks: True when any rank says so."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    value = torch.tensor([int(flag)])
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def _log_step(
    state: GlobalState,
    loss_dict: dict[str, torch.Tensor],
    grad_norm: float | None,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Every ``logger.log_interval`` steps: one log line and the TensorBoard scalars."""
    ts, cfg = state.train_state, state.cfg
    if not cfg.logger.log_interval or ts.step % cfg.logger.log_interval:
        return
    lr = optimizer.param_groups[0]["lr"]
    losses = {key: float(value) for key, value in loss_dict.items()}
    writer = state.tensorboard_logger
    if writer is not None:
        writer.add_scalar("learning-rate", lr, ts.step)
        for key, value in losses.items():
            writer.add_scalar(key, value, ts.step)
        if grad_norm is not None:
            writer.add_scalar("grad-norm", grad_norm, ts.step)
    parts = [
        f"iteration {ts.step:8d}/{cfg.train.train_iters:8d}",
        f"consumed samples: {ts.consumed_train_samples:12d}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {cfg.train.global_batch_size:5d}",
        *(f"{key}: {value:.6E}" for key, value in losses.items()),
    ]
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    logger.info(" | ".join(parts))


def _context(
    manager: CallbackManager, state: GlobalState, model: list[Any], optimizer: Any, scheduler: Any
) -> CallbackContext:
    return CallbackContext(
        state=state,
        model=model,
        user_state=manager.user_state,
        optimizer=optimizer,
        scheduler=scheduler,
    )


def _fire(
    manager: CallbackManager | None,
    event: str,
    state: GlobalState,
    model: list[Any],
    optimizer: Any,
    scheduler: Any,
) -> None:
    if should_fire(manager, event):
        assert manager is not None
        manager.fire(event, _context(manager, state, model, optimizer, scheduler))
