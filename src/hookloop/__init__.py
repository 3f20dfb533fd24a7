"""hookloop: a PyTorch training loop you can read in one sitting, built around events.

The public names below are imported on first use (PEP 562), so ``import hookloop``
and the ``hookloop`` commands that never train (``jobs``, ``ctl``, ``runs``,
``--version``) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hookloop.callback import Callback, Stateful
    from hookloop.config import (
        CheckpointConfig,
        Config,
        DataConfig,
        LoggingConfig,
        ModelConfig,
        OptimizerConfig,
        SchedulerConfig,
        TrainConfig,
    )
    from hookloop.entry import finetune, pretrain, seed_everything
    from hookloop.events import Event
    from hookloop.manager import CallbackManager
    from hookloop.result import ExitCode, TrainResult
    from hookloop.rundir import RunDir
    from hookloop.state import CallbackContext, Control, RunInfo, TrainState
    from hookloop.trainer import Trainer

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_HOMES = {
    "Callback": "hookloop.callback",
    "Stateful": "hookloop.callback",
    "CheckpointConfig": "hookloop.config",
    "Config": "hookloop.config",
    "DataConfig": "hookloop.config",
    "LoggingConfig": "hookloop.config",
    "ModelConfig": "hookloop.config",
    "OptimizerConfig": "hookloop.config",
    "SchedulerConfig": "hookloop.config",
    "TrainConfig": "hookloop.config",
    "finetune": "hookloop.entry",
    "pretrain": "hookloop.entry",
    "seed_everything": "hookloop.entry",
    "Event": "hookloop.events",
    "Trainer": "hookloop.trainer",
    "CallbackManager": "hookloop.manager",
    "ExitCode": "hookloop.result",
    "TrainResult": "hookloop.result",
    "RunDir": "hookloop.rundir",
    "CallbackContext": "hookloop.state",
    "Control": "hookloop.state",
    "RunInfo": "hookloop.state",
    "TrainState": "hookloop.state",
}

__all__ = [
    "Callback",
    "CallbackContext",
    "CallbackManager",
    "CheckpointConfig",
    "Config",
    "Control",
    "DataConfig",
    "Event",
    "ExitCode",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunDir",
    "RunInfo",
    "SchedulerConfig",
    "Stateful",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "Trainer",
    "finetune",
    "pretrain",
    "seed_everything",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module the first time the name is asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hookloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
