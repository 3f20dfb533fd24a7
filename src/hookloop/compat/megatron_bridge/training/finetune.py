"""``finetune(config, forward_step_func, callbacks=...)``: ``pretrain`` from pretrained weights.

The weights come from the container's ``checkpoint.pretrained_checkpoint`` (or
a native config's ``checkpoint.pretrained``): a checkpoint directory or a
``.safetensors`` file. Only the weights are loaded: a fresh optimizer, schedule
and data order, as :func:`hookloop.entry.finetune`. With ``resume`` (or a
container's ``checkpoint.load``) an interrupted fine-tuning run continues
instead, from its own checkpoint. Without either, a container fails with an
``AssertionError``, as Megatron-Bridge asserts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.pretrain import (
    AnyConfig,
    Callbacks,
    ForwardStepFunc,
    run,
)
from hookloop.result import TrainResult


def finetune(
    config: AnyConfig,
    forward_step_func: ForwardStepFunc,
    callbacks: Callbacks = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    process_non_loss_data_func: Callable[[Any, int, Any], Any] | None = None,
) -> TrainResult:
    """Fine-tune the pretrained weights the config names; arguments as ``pretrain``.

    As Megatron-Bridge's, a container without ``checkpoint.pretrained_checkpoint`` or
    ``checkpoint.load`` fails with an ``AssertionError`` (raised even under ``python -O``).
    """
    if isinstance(config, ConfigContainer) and resume is None:
        ck = config.checkpoint
        if ck.pretrained_checkpoint is None and ck.load is None:
            raise AssertionError(
                "finetune() needs pretrained weights or a run to resume: set "
                "config.checkpoint.pretrained_checkpoint (a checkpoint directory or a "
                ".safetensors file) or config.checkpoint.load"
            )
    return run(
        config,
        forward_step_func,
        callbacks,
        out_dir=out_dir,
        resume=resume,
        pretrained=True,
        non_loss_data_func=non_loss_data_func,
        process_non_loss_data_func=process_non_loss_data_func,
    )
