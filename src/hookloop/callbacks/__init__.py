"""Built-in callbacks. Each is optional; the loop never depends on one.

Native names only: the compatible systems' names (``NaNDetectionCallback``,
``ProgressCallback``, ...) live with their dialects in :mod:`hookloop.compat`,
and importing one from here says where. Optional libraries (optuna, wandb,
tensorboard, mlflow) are imported only when their callback is built.

Each built-in's priority is its class's ``priority`` attribute, within the bands of
:data:`hookloop.callback.PRIORITY_BANDS`; docs/callbacks.md's priority table is
generated from them (``scripts/docs_reference.py``).

JsonLogger, CSVLogger, TBLogger, WandbLoggingCallback and MLflowLogger are backends of
:class:`Logger` (:mod:`hookloop.callbacks.logger`), which owns what every logger does the same way:
the events, rank 0 alone writing, the cut back on resume and rewind, the flushes.
"""

from hookloop.callbacks.checkpoint_policy import CheckpointPolicy
from hookloop.callbacks.csv_logger import CSVLogger
from hookloop.callbacks.defaults import default_callbacks
from hookloop.callbacks.diloco import DiLoCo
from hookloop.callbacks.divergence import DivergenceDetector, SpikeTracker
from hookloop.callbacks.early_stopping import EarlyStopping
from hookloop.callbacks.ema import EMA
from hookloop.callbacks.grad_monitor import GradientMonitor
from hookloop.callbacks.info import InfoCallback
from hookloop.callbacks.jsonlog import JsonLogger, read_jsonl
from hookloop.callbacks.logger import Logger, Record
from hookloop.callbacks.loss_prediction import LossPrediction
from hookloop.callbacks.memory import PeakMemory
from hookloop.callbacks.metrics import DefaultMetrics
from hookloop.callbacks.mlflow_logger import MLflowLogger
from hookloop.callbacks.model_summary import ModelSummary
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

_HPO = ("hookloop.compat.hpo", "the HPO trainer")
_FORGATHER = ("hookloop.compat.forgather", "Forgather")

#: Another system's name for a built-in -> (the compat module that has it, the system,
#: the native callback here).
DIALECT_NAMES = {
    **{
        name: (*_HPO, native)
        for name, native in (
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
    "DiLoCoCallback": (*_FORGATHER, "DiLoCo"),
    "ProgressCallback": (*_FORGATHER, "ProgressBar"),
}


def __getattr__(name: str) -> object:
    if name in DIALECT_NAMES:
        home, system, native = DIALECT_NAMES[name]
        # ImportError, not AttributeError: `from ... import` keeps this message
        raise ImportError(
            f"{name} is {system}'s name; import it with `from {home} import {name}` "
            f"({system}'s constructor and behaviour), or use the native {native} from "
            "hookloop.callbacks",
            name=__name__,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EMA",
    "CSVLogger",
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
    "MLflowLogger",
    "MetricTracker",
    "ModelSummary",
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
