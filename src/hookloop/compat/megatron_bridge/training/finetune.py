"""``finetune(config, forward_step_func, callbacks=...)``: ``pretrain`` from pretrained weights.

The weights come from ``config.checkpoint.pretrained`` (a checkpoint directory
or a ``.safetensors`` file), as in :func:`hookloop.entry.finetune`.
"""

from __future__ import annotations

from pathlib import Path

from hookloop import entry
from hookloop.compat.megatron_bridge.training.pretrain import Callbacks, ForwardStepFunc, prepare
from hookloop.config import Config
from hookloop.trainer import TrainResult


def finetune(
    config: Config,
    forward_step_func: ForwardStepFunc,
    callbacks: Callbacks = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
) -> TrainResult:
    """Fine-tune the weights at ``config.checkpoint.pretrained``; arguments as ``pretrain``."""
    step, manager = prepare(config, forward_step_func, callbacks)
    return entry.finetune(config, step, manager.native, out_dir=out_dir, resume=resume)
