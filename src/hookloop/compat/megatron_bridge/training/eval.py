"""Validation and test passes of a :func:`~.train.train` run, as Megatron-Bridge runs them.

:func:`evaluate` runs ``cfg.train.eval_iters`` iterations of one global batch each,
without gradients, firing ``on_eval_*`` (or ``on_test_*``) and counting
``train_state.consumed_valid_samples`` by one global batch per iteration. Its losses
are summed over every iteration ( ``[sum, count]`` values as sums, one-element values
by micro-batch) and divided at the end. :func:`evaluate_and_print_results` logs them
with their perplexity and writes them to the TensorBoard writer, as
``"<key> validation"``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.callbacks import (
    CallbackContext,
    CallbackManager,
    should_fire,
)
from hookloop.compat.megatron_bridge.training.forward_backward import (
    forward_backward,
    num_microbatches,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.distributed import rank_info

logger = logging.getLogger("megatron.bridge.training.eval")

ForwardStep = Callable[[Iterator[Any], Any], tuple[Any, Callable[[Any], Any]]]


def evaluate(
    state: GlobalState,
    forward_step: ForwardStep,
    data_iterator: Iterator[Any] | None,
    model: list[torch.nn.Module],
    *,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    callback_manager: CallbackManager | None = None,
    is_test: bool = False,
) -> tuple[dict[str, torch.Tensor], Any]:
    """``(total_loss_dict, non-loss data)`` over ``cfg.train.eval_iters`` iterations.

    ``forward_step`` takes ``(data_iterator, model)``, the state already bound.
    """
    cfg = state.cfg.train
    kind = "test" if is_test else "eval"
    count = num_microbatches(
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        data_parallel_size=rank_info()[2],
    )
    _fire(callback_manager, f"on_{kind}_start", state, model)
    for chunk in model:
        chunk.eval()
    sums: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for _ in range(cfg.eval_iters):
                _fire(callback_manager, f"on_{kind}_step_start", state, model)
                what = "test_data_iterator" if is_test else "valid_data_iterator"
                loss_dicts = forward_backward(
                    forward_step, data_iterator, model[0], count, forward_only=True, what=what
                )
                _fire(callback_manager, f"on_{kind}_step_end", state, model)
                _accumulate(sums, loss_dicts)
                state.train_state.consumed_valid_samples += cfg.global_batch_size
        non_loss_data = non_loss_data_func(model) if non_loss_data_func is not None else None
    finally:
        for chunk in model:
            chunk.train()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for total in sums.values():
            torch.distributed.all_reduce(total)
    total_loss_dict = {key: total[0] / total[1] for key, total in sums.items()}
    if should_fire(callback_manager, f"on_{kind}_end"):
        assert callback_manager is not None
        context = _context(callback_manager, state, model)
        context.total_loss_dict = total_loss_dict
        context.non_loss_data = non_loss_data
        callback_manager.fire(f"on_{kind}_end", context)
    return total_loss_dict, non_loss_data


def evaluate_and_print_results(
    state: GlobalState,
    prefix: str,
    forward_step: ForwardStep,
    data_iterator: Iterator[Any] | None,
    model: list[torch.nn.Module],
    *,
    process_non_loss_data_func: Callable[[Any, int, Any], Any] | None = None,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    callback_manager: CallbackManager | None = None,
    is_test: bool = False,
) -> dict[str, torch.Tensor]:
    """:func:`evaluate`, then log each loss and its perplexity and write them to TensorBoard."""
    total_loss_dict, non_loss_data = evaluate(
        state,
        forward_step,
        data_iterator,
        model,
        non_loss_data_func=non_loss_data_func,
        callback_manager=callback_manager,
        is_test=is_test,
    )
    step, writer = state.train_state.step, state.tensorboard_logger
    label = "test" if is_test else "validation"
    parts = [f"{label} loss at {prefix}"]
    for key, value in total_loss_dict.items():
        loss = float(value)
        ppl = math.exp(min(20.0, loss))
        parts.append(f"{key} value: {loss:.6E} | {key} PPL: {ppl:.6E}")
        if writer is not None:
            writer.add_scalar(f"{key} {label}", loss, step)
            writer.add_scalar(f"{key} {label} ppl", ppl, step)
    logger.info(" | ".join(parts))
    if process_non_loss_data_func is not None and non_loss_data is not None:
        process_non_loss_data_func(non_loss_data, step, writer)
    return total_loss_dict


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
