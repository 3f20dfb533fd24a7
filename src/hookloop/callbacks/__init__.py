"""Built-in callbacks. Each is optional; the loop never depends on one.

Native names only: the seed documents' names (``NaNDetectionCallback``,
``ProgressCallback``, ...) live with their dialects in :mod:`hookloop.compat`,
and importing one from here says where. Optional libraries (optuna, wandb,
tensorboard) are imported only when their callback is built.

Priorities (lower runs earlier): InfoCallback 1, StragglerDetection 2, NaNDetection 5,
OptimizerMode 10, GradientMonitor 12, ProfilerCallback 15, DiLoCo 15, DefaultMetrics 20,
norm loggers 25, PeakMemory 30, TextgenCallback 60, LossPrediction 70,
OverfitDetection 75, DivergenceDetector 80, WandbLoggingCallback 80,
OptunaPruning 85, EarlyStopping 90, CheckpointPolicy 95, JsonLogger 100,
ProgressLog 100, TBLogger 100, ProgressBar 110.

JsonLogger, TBLogger and WandbLoggingCallback are backends of :class:`Logger`
(:mod:`hookloop.callbacks.logger`), which owns what every logger does the same way:
the events, rank 0 alone writing, the cut back on resume and rewind, the flushes.
"""

from hookloop.callbacks.checkpoint_policy import CheckpointPolicy
from hookloop.callbacks.defaults import default_callbacks
from hookloop.callbacks.diloco import DiLoCo
from hookloop.callbacks.divergence import DivergenceDetector, SpikeTracker
from hookloop.callbacks.early_stopping import EarlyStopping
from hookloop.callbacks.grad_monitor import GradientMonitor
from hookloop.callbacks.info import InfoCallback
from hookloop.callbacks.jsonlog import JsonLogger, read_jsonl
from hookloop.callbacks.logger import Logger, Record
from hookloop.callbacks.loss_prediction import LossPrediction
from hookloop.callbacks.memory import PeakMemory
from hookloop.callbacks.metrics import DefaultMetrics
from hookloop.callbacks.monitor import MetricTracker
from hookloop.callbacks.nan_detection import NaNDetection
from hookloop.callbacks.norms import GradNormLogger, ParameterNormLogger, WeightNormLogger
from hookloop.callbacks.optimizer_mode import OptimizerMode
from hookloop.callbacks.optuna_pruning import OptunaPruning
from hookloop.callbacks.overfit import OverfitDetection
from hookloop.callbacks.profiler import ProfilerCallback
from hookloop.callbacks.progress import ProgressBar, format_metrics
from hookloop.callbacks.progress_log import ProgressLog
from hookloop.callbacks.straggler import StragglerDetection
from hookloop.callbacks.tensorboard import ResumableSummaryWriter, TBLogger
from hookloop.callbacks.textgen import TextgenCallback
from hookloop.callbacks.wandb_logger import WandbLoggingCallback

#: A seed document's name -> (the compat module that has it, the native callback here).
SEED_NAMES = {
    **{
        seed: ("hookloop.compat.hpo", native)
        for seed, native in (
            ("CheckpointCallback", "CheckpointPolicy"),
            ("EarlyStoppingCallback", "EarlyStopping"),
            ("GradientMonitorCallback", "GradientMonitor"),
            ("LossPredictionCallback", "LossPrediction"),
            ("NaNDetectionCallback", "NaNDetection"),
            ("OptimizerModeCallback", "OptimizerMode"),
            ("OverfitDetectionCallback", "OverfitDetection"),
            ("PrunerCallback", "OptunaPruning"),
        )
    },
    "DiLoCoCallback": ("hookloop.compat.hf", "DiLoCo"),
    "ProgressCallback": ("hookloop.compat.hf", "ProgressBar"),
}


def __getattr__(name: str) -> object:
    if name in SEED_NAMES:
        home, native = SEED_NAMES[name]
        # ImportError, not AttributeError: `from ... import` keeps this message
        raise ImportError(
            f"{name} is a seed document's name; import it with `from {home} import {name}` "
            f"(the seed's constructor and behaviour), or use the native {native} from "
            "hookloop.callbacks",
            name=__name__,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointPolicy",
    "DefaultMetrics",
    "DiLoCo",
    "DivergenceDetector",
    "EarlyStopping",
    "GradNormLogger",
    "GradientMonitor",
    "InfoCallback",
    "JsonLogger",
    "Logger",
    "LossPrediction",
    "MetricTracker",
    "NaNDetection",
    "OptimizerMode",
    "OptunaPruning",
    "OverfitDetection",
    "ParameterNormLogger",
    "PeakMemory",
    "ProfilerCallback",
    "ProgressBar",
    "ProgressLog",
    "Record",
    "ResumableSummaryWriter",
    "SpikeTracker",
    "StragglerDetection",
    "TBLogger",
    "TextgenCallback",
    "WandbLoggingCallback",
    "WeightNormLogger",
    "default_callbacks",
    "format_metrics",
    "read_jsonl",
]
