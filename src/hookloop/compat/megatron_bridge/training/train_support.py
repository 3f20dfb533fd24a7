"""What :func:`~.train.train` checks and computes besides Megatron-Bridge's 14 functions.

The checks of ``train()``'s arguments (one line naming what is wrong), the binding of
a forward step to the run's state, the agreement of an exit flag across ranks and
``train.manual_gc``'s garbage collection.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.megatron_core import check_chunks, chunk_device
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.distributed import agree_flags, is_distributed, rank_info
from hookloop.step import bind_forward_step

ForwardStepFunc = Callable[..., tuple[Any, Callable[[Any], Any]]]


def check_train_inputs(
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


def bind_step(forward_step_func: ForwardStepFunc, global_state: GlobalState) -> Callable[..., Any]:
    """``forward_step_func`` as ``(data_iterator, model)``, the state bound when it takes it."""
    if not callable(forward_step_func):
        raise TypeError(
            "forward_step_func must be callable as (global_state, data_iterator, model) or "
            f"(data_iterator, model), got {type(forward_step_func).__name__}"
        )
    return functools.partial(bind_forward_step(forward_step_func), global_state)


def agreed(flag: bool, model: list[Any]) -> bool:
    """``flag`` agreed over ranks (True when any rank says so), through the one helper
    the native loop agrees with, on the device of ``model``'s chunk (which the process
    group's backend reaches: NCCL refuses host tensors)."""
    if not is_distributed():
        return flag
    return bool(agree_flags([int(flag)], chunk_device(model))[0])


@contextlib.contextmanager
def manual_gc(train_cfg: Any) -> Iterator[None]:
    """With ``train.manual_gc``: the automatic collector off (after one full collection)
    while the loop runs, as Megatron-Bridge aligns collections across ranks; on again after."""
    if not train_cfg.manual_gc:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
