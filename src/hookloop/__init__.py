"""hookloop: a PyTorch training loop you can read in one sitting, built around events."""

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
from hookloop.loop import Trainer
from hookloop.manager import CallbackManager
from hookloop.result import ExitCode, TrainResult
from hookloop.rundir import RunDir
from hookloop.state import CallbackContext, Control, RunInfo, TrainState

__version__ = "0.1.0"

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
