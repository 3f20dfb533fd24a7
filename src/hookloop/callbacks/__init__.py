"""Built-in callbacks. Each is optional; the loop never depends on one.

Native names, with the seed documents' names as aliases where they differ so
that code written against those APIs reads the same. Optional libraries
(optuna, wandb, tensorboard) are imported only when their callback is built.

Priorities (lower runs earlier): InfoCallback 1, StragglerDetection 2, NaNDetection 5,
OptimizerMode 10, GradientMonitor 12, ProfilerCallback 15, DiLoCo 15, DefaultMetrics 20,
norm loggers 25, PeakMemory 30, TextgenCallback 60, LossPrediction 70,
OverfitDetection 75, DivergenceDetector 80, WandbLoggingCallback 80,
OptunaPruning 85, EarlyStopping 90, CheckpointPolicy 95, JsonLogger 100,
ProgressLog 100, TBLogger 100, ProgressBar 110.
"""

from hookloop.callbacks.checkpoint_policy import CheckpointCallback, CheckpointPolicy
from hookloop.callbacks.defaults import default_callbacks
from hookloop.callbacks.diloco import DiLoCo, DiLoCoCallback
from hookloop.callbacks.divergence import DivergenceDetector, SpikeTracker
from hookloop.callbacks.early_stopping import EarlyStopping, EarlyStoppingCallback
from hookloop.callbacks.grad_monitor import GradientMonitor, GradientMonitorCallback
from hookloop.callbacks.info import InfoCallback
from hookloop.callbacks.jsonlog import JsonLogger, read_jsonl
from hookloop.callbacks.loss_prediction import LossPrediction, LossPredictionCallback
from hookloop.callbacks.memory import PeakMemory
from hookloop.callbacks.metrics import DefaultMetrics
from hookloop.callbacks.monitor import MetricTracker
from hookloop.callbacks.nan_detection import NaNDetection, NaNDetectionCallback
from hookloop.callbacks.norms import GradNormLogger, ParameterNormLogger, WeightNormLogger
from hookloop.callbacks.optimizer_mode import OptimizerMode, OptimizerModeCallback
from hookloop.callbacks.optuna_pruning import OptunaPruning, PrunerCallback
from hookloop.callbacks.overfit import OverfitDetection, OverfitDetectionCallback
from hookloop.callbacks.profiler import ProfilerCallback
from hookloop.callbacks.progress import ProgressBar, ProgressCallback, format_metrics
from hookloop.callbacks.progress_log import ProgressLog
from hookloop.callbacks.straggler import StragglerDetection
from hookloop.callbacks.tensorboard import ResumableSummaryWriter, TBLogger
from hookloop.callbacks.textgen import TextgenCallback
from hookloop.callbacks.wandb_logger import WandbLoggingCallback

__all__ = [
    "CheckpointCallback",
    "CheckpointPolicy",
    "DefaultMetrics",
    "DiLoCo",
    "DiLoCoCallback",
    "DivergenceDetector",
    "EarlyStopping",
    "EarlyStoppingCallback",
    "GradNormLogger",
    "GradientMonitor",
    "GradientMonitorCallback",
    "InfoCallback",
    "JsonLogger",
    "LossPrediction",
    "LossPredictionCallback",
    "MetricTracker",
    "NaNDetection",
    "NaNDetectionCallback",
    "OptimizerMode",
    "OptimizerModeCallback",
    "OptunaPruning",
    "OverfitDetection",
    "OverfitDetectionCallback",
    "ParameterNormLogger",
    "PeakMemory",
    "ProfilerCallback",
    "ProgressBar",
    "ProgressCallback",
    "ProgressLog",
    "PrunerCallback",
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
