"""Validation and test passes of a :func:`~.train.train` run, as Megatron-Bridge runs them.

:func:`evaluate` (Megatron-Bridge's signature and its three return values) runs
``cfg.train.eval_iters`` iterations of one global batch each,
without gradients, firing ``on_eval_*`` (or ``on_test_*``) and counting
``train_state.consumed_valid_samples`` by one global batch per iteration. Its losses
are summed over every iteration ( ``[sum, count]`` values as sums, one-element values
by micro-batch) and divided at the end; a ``train.exit_duration_in_mins`` that passes
meanwhile ends it early. :func:`evaluate_and_print_results` logs them with their
perplexity and writes them to the TensorBoard and W&B writers as ``"<key> validation"``
(and ``… vs samples``; the perplexity with ``logger.log_validation_ppl_to_tensorboard``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.callbacks import (
    CallbackContext,
    CallbackManager,
    should_fire,
)
from hookloop.compat.megatron_bridge.training.loggers import write_validation_scalars
from hookloop.compat.megatron_bridge.training.megatron_core import chunk_device
from hookloop.compat.megatron_bridge.training.microbatches import (
    forward_passes,
    microbatches,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.compat.megatron_bridge.training.train_support import agreed
from hookloop.distributed import all_reduce_sum, is_distributed

logger = logging.getLogger("megatron.bridge.training.eval")

ForwardStep = Callable[[Iterator[Any], Any], tuple[Any, Callable[[Any], Any]]]


def evaluate(
    state: GlobalState,
    forward_step_func: ForwardStep,
    data_iterator: Iterator[Any] | None,
    model: list[torch.nn.Module],
    process_non_loss_data_func: Callable[[Any, int, Any], Any] | None,
    config: Any,
    verbose: bool = False,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    callback_manager: CallbackManager | None = None,
    is_test: bool = False,
) -> tuple[dict[str, torch.Tensor] | None, Any, bool]:
    """``(total_loss_dict, non-loss data, timelimit_hit)`` over ``cfg.train.eval_iters``
    iterations; ``(None, None, True)`` when ``train.exit_duration_in_mins`` passed meanwhile.

    ``forward_step_func`` takes ``(data_iterator, model)``, the state already bound.
    ``config`` (Megatron-Bridge passes the model's config) is not read;
    ``p2p_communicator`` and ``pg_collection`` (pipeline stages) must be None.
    """
    _refuse_pipeline_arguments(p2p_communicator, pg_collection)
    cfg = state.cfg.train
    kind = "test" if is_test else "eval"
    if verbose:
        logger.info("Evaluating on %d samples", cfg.eval_iters * cfg.global_batch_size)
    timer = state.timers("evaluate", log_level=0)
    timer.start()
    _fire(callback_manager, f"on_{kind}_start", state, model)
    for chunk in model:
        chunk.eval()
    try:
        with torch.no_grad():
            sums = _iterations(
                state, forward_step_func, data_iterator, model, kind, verbose, callback_manager
            )
            if sums is None:
                logger.info("Exiting during evaluation, timelimit reached")
                return None, None, True
        non_loss_data = non_loss_data_func(model) if non_loss_data_func is not None else None
    finally:
        for chunk in model:
            chunk.train()
        if timer.active:
            timer.stop()
    state.timers.log(["evaluate"])
    if is_distributed():  # every rank's sums, on a device the backend reaches
        device = chunk_device(model)
        sums = {key: all_reduce_sum(total.to(device)) for key, total in sums.items()}
    total_loss_dict = {key: total[0] / total[1] for key, total in sums.items()}
    if should_fire(callback_manager, f"on_{kind}_end"):
        assert callback_manager is not None
        context = _context(callback_manager, state, model)
        context.total_loss_dict = total_loss_dict
        context.non_loss_data = non_loss_data
        callback_manager.fire(f"on_{kind}_end", context)
    return total_loss_dict, non_loss_data, False


def _iterations(
    state: GlobalState,
    forward_step_func: ForwardStep,
    data_iterator: Iterator[Any] | None,
    model: list[torch.nn.Module],
    kind: str,
    verbose: bool,
    callback_manager: CallbackManager | None,
) -> dict[str, torch.Tensor] | None:
    """``cfg.train.eval_iters`` iterations of one global batch: each loss's
    ``[sum, count]`` on this rank (None: the time limit passed meanwhile)."""
    cfg, count = state.cfg.train, microbatches(state)
    what = "test_data_iterator" if kind == "test" else "valid_data_iterator"
    sums: dict[str, torch.Tensor] = {}
    for iteration in range(1, cfg.eval_iters + 1):
        if verbose:
            logger.info("Evaluating iter %d/%d", iteration, cfg.eval_iters)
        _fire(callback_manager, f"on_{kind}_step_start", state, model)
        loss_dicts = forward_passes(forward_step_func, data_iterator, model[0], count, what=what)
        _fire(callback_manager, f"on_{kind}_step_end", state, model)
        _accumulate(sums, loss_dicts)
        state.train_state.consumed_valid_samples += cfg.global_batch_size
        if _time_is_up(state, model):
            return None
    return sums


def evaluate_and_print_results(
    state: GlobalState,
    prefix: str,
    forward_step_func: ForwardStep,
    data_iterator: Iterator[Any] | None,
    model: list[torch.nn.Module],
    config: Any,
    verbose: bool = False,
    write_to_tensorboard: bool = True,
    process_non_loss_data_func: Callable[[Any, int, Any], Any] | None = None,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    callback_manager: CallbackManager | None = None,
    is_test: bool = False,
) -> dict[str, torch.Tensor] | None:
    """:func:`evaluate`, then log each loss and its perplexity and write them to the
    writers; returns the losses (None when the time limit cut the evaluation short)."""
    total_loss_dict, non_loss_data, timelimit_hit = evaluate(
        state,
        forward_step_func,
        data_iterator,
        model,
        process_non_loss_data_func,
        config,
        verbose,
        non_loss_data_func,
        p2p_communicator,
        pg_collection,
        callback_manager,
        is_test,
    )
    if timelimit_hit or total_loss_dict is None:
        return None
    ts = state.train_state
    writer = state.tensorboard_logger if write_to_tensorboard else None
    label = "test" if is_test else "validation"
    losses = {key: float(value) for key, value in total_loss_dict.items()}
    parts = [f"{label} loss at {prefix}"]
    for key, loss in losses.items():
        parts.append(f"{key} value: {loss:.6E} | {key} PPL: {math.exp(min(20.0, loss)):.6E}")
    logger.info(" | ".join(parts))
    write_validation_scalars(
        writer,
        state.wandb_logger,
        step=ts.step,
        samples=ts.consumed_train_samples,
        losses=losses,
        label=label,
        ppl=bool(getattr(state.cfg.logger, "log_validation_ppl_to_tensorboard", False)),
    )
    if process_non_loss_data_func is not None and non_loss_data is not None and writer:
        process_non_loss_data_func(non_loss_data, ts.step, writer)
    return total_loss_dict


def _refuse_pipeline_arguments(p2p_communicator: Any, pg_collection: Any) -> None:
    for name, value in (("p2p_communicator", p2p_communicator), ("pg_collection", pg_collection)):
        if value is not None:
            raise ValueError(
                f"{name} is for Megatron-Core pipeline stages; the dialect evaluates one "
                f"model chunk: leave {name}=None"
            )


def _time_is_up(state: GlobalState, model: list[torch.nn.Module]) -> bool:
    """Whether ``train.exit_duration_in_mins`` has passed since the job started, on any rank."""
    minutes = state.cfg.train.exit_duration_in_mins
    if not minutes:
        return False
    return agreed((time.time() - state.start_time) / 60.0 > minutes, model)


def _accumulate(sums: dict[str, torch.Tensor], loss_dicts: list[dict[str, Any]]) -> None:
    """Add one iteration's micro-batch losses to ``sums`` (``[numerator, denominator]``)."""
    for key in loss_dicts[0] if loss_dicts else ():
        values = [torch.as_tensor(d[key]).detach().reshape(-1).float() for d in loss_dicts]
        total = sums.setdefault(key, torch.zeros(2, dtype=torch.float32))
        if values[0].numel() == 2:
            total += torch.stack(values).sum(dim=0).to(total.device)
        elif values[0].numel() == 1:
            total[0] += torch.cat(values).sum().to(total.device)
            total[1] += len(values)
        else:
            raise ValueError(
                f"loss_dict[{key!r}] must hold 1 value (a mean) or 2 values ([sum, count]), "
                f"got shape {tuple(values[0].shape)}"
            )


def _context(manager: CallbackManager, state: GlobalState, model: list[Any]) -> CallbackContext:
    return CallbackContext(state=state, model=model, user_state=manager.user_state)


def _fire(
    manager: CallbackManager | None, event: str, state: GlobalState, model: list[Any]
) -> None:
    if should_fire(manager, event):
        assert manager is not None
        manager.fire(event, _context(manager, state, model))
