"""``save_checkpoint``: a checkpoint of a :func:`~.train.train` run, in hookloop's format.

The checkpoint goes to ``<cfg.checkpoint.save>/checkpoints/step-NNNNNNNN`` through
:mod:`hookloop.checkpoint` (atomic, with a manifest), holding the model chunk, the
optimizer, the scheduler, Megatron-Bridge's ``train_state`` and every RNG. The
:class:`~hookloop.checkpoint.CheckpointManager` of the run lives in the
``checkpointing_context`` dict Megatron-Bridge threads through its loop, made on the
first save. After each save ``on_checkpoint_save`` fires with the optimizer and the
checkpoint's path (``context.checkpoint_path``), as the dialect fires it from
``pretrain()``. The signature is Megatron-Bridge's; like it, it returns None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hookloop.checkpoint import CheckpointManager, RNGState, SavePolicy
from hookloop.compat.megatron_bridge.training.callbacks import (
    CallbackContext,
    CallbackManager,
    should_fire,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.rundir import RunDir

#: Where the run's CheckpointManager is kept in ``checkpointing_context``.
MANAGER_KEY = "hookloop_checkpoints"


def save_checkpoint(
    state: GlobalState,
    model: list[Any],
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any] | None = None,
    pipeline_rank: int | None = None,
    tensor_rank: int | None = None,
    non_persistent_ckpt: bool = False,
    train_data_iterator: Any = None,
    preprocess_common_state_dict_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    prebuilt_state_dict: dict[str, Any] | None = None,
    pg_collection: Any = None,
    callback_manager: CallbackManager | None = None,
    module_name: str | None = None,
) -> None:
    """Save the run at ``state.train_state.step`` (nothing when that step is saved already).

    Every rank calls it; rank 0 writes. The FLOPs count saved is ``train_state``'s (the
    one ``num_floating_point_operations_so_far`` is taken from). The data iterator's
    position is not saved. The Megatron-Core-only arguments (``pipeline_rank``,
    ``tensor_rank``, ``non_persistent_ckpt``, ``preprocess_common_state_dict_fn``,
    ``prebuilt_state_dict``, ``pg_collection``, ``module_name``) must keep their defaults.
    """
    _refuse_megatron_core_arguments(
        pipeline_rank=pipeline_rank,
        tensor_rank=tensor_rank,
        non_persistent_ckpt=non_persistent_ckpt or None,
        preprocess_common_state_dict_fn=preprocess_common_state_dict_fn,
        prebuilt_state_dict=prebuilt_state_dict,
        pg_collection=pg_collection,
        module_name=module_name,
    )
    manager = _run_manager(state, checkpointing_context)
    named: dict[str, Any] = {"model": model[0], "optimizer": optimizer}
    if hasattr(opt_param_scheduler, "state_dict"):
        named["scheduler"] = opt_param_scheduler
    named |= {"train_state": state.train_state, "rng": RNGState()}
    cfg = state.cfg
    path = manager.save(
        named,
        step=state.train_state.step,
        epoch=0,
        config=cfg.to_dict() if hasattr(cfg, "to_dict") else None,
    )
    if path is not None and should_fire(callback_manager, "on_checkpoint_save"):
        assert callback_manager is not None
        context = CallbackContext(
            state=state, model=model, user_state=callback_manager.user_state, optimizer=optimizer
        )
        context.checkpoint_path = path
        callback_manager.fire("on_checkpoint_save", context)


def _run_manager(state: GlobalState, checkpointing_context: Any) -> CheckpointManager:
    """The run's CheckpointManager, kept in ``checkpointing_context`` (made on first use)."""
    save = state.cfg.checkpoint.save
    if save is None:
        raise ValueError("saving a checkpoint needs cfg.checkpoint.save (the run directory)")
    if checkpointing_context is None:
        checkpointing_context = {}
    if not isinstance(checkpointing_context, dict):
        raise TypeError(
            "checkpointing_context must be a dict (start with {}) or None, got "
            f"{type(checkpointing_context).__name__}"
        )
    manager = checkpointing_context.get(MANAGER_KEY)
    if manager is None:
        manager = CheckpointManager(RunDir(save).checkpoints, SavePolicy(keep_last=None))
        checkpointing_context[MANAGER_KEY] = manager
    return manager


def _refuse_megatron_core_arguments(**given: Any) -> None:
    """One line naming the first argument that only Megatron-Core's checkpointing takes."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(
                f"save_checkpoint({name}={value!r}) needs Megatron-Core's distributed "
                f"checkpointing; the dialect saves one hookloop checkpoint: leave {name} at "
                "its default"
            )
