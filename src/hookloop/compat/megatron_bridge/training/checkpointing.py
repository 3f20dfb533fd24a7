"""``save_checkpoint``: a checkpoint of a :func:`~.train.train` run, in hookloop's format.

The checkpoint goes to ``<cfg.checkpoint.save>/checkpoints/step-NNNNNNNN`` through
:mod:`hookloop.checkpoint` (atomic, with a manifest), holding the model chunk, the
optimizer, the scheduler, Megatron-Bridge's ``train_state`` and every RNG. The
:class:`~hookloop.checkpoint.CheckpointManager` of the run lives in the
``checkpointing_context`` dict Megatron-Bridge threads through its loop, made on the
first save. After each save ``on_checkpoint_save`` fires with the optimizer and the
checkpoint's path, as the dialect fires it from ``pretrain()``.
"""

from __future__ import annotations

from pathlib import Path
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
    scheduler: Any,
    checkpointing_context: dict[str, Any],
    *,
    callback_manager: CallbackManager | None = None,
) -> Path | None:
    """Save the run at ``state.train_state.step``; return the checkpoint's directory.

    Returns None when this step is already saved. Every rank calls it; rank 0 writes.
    """
    save = state.cfg.checkpoint.save
    if save is None:
        raise ValueError("saving a checkpoint needs cfg.checkpoint.save (the run directory)")
    if not isinstance(checkpointing_context, dict):
        raise TypeError(
            "checkpointing_context must be a dict (start with {}), got "
            f"{type(checkpointing_context).__name__}"
        )
    manager = checkpointing_context.get(MANAGER_KEY)
    if manager is None:
        manager = CheckpointManager(RunDir(save).checkpoints, SavePolicy(keep_last=None))
        checkpointing_context[MANAGER_KEY] = manager
    named: dict[str, Any] = {"model": model[0], "optimizer": optimizer}
    if hasattr(scheduler, "state_dict"):
        named["scheduler"] = scheduler
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
    return path
