"""Forgather's built-in callbacks, with Forgather's constructors and behaviour.

A configuration written for Forgather builds these by name with its
arguments (same names, order and defaults) and gets what Forgather says each
one writes: ``trainer_logs.json``, ``gradient_norms.json`` and
``parameter_norms.json`` as JSON arrays in ``args.logging_dir``, TensorBoard
text and scalars through the ``summary_writer`` it is given, and the log keys
``tok_per_sec`` / ``mfu`` / ``peak_mem``.

Where a native built-in already does the job the class here is a thin subclass
that only translates the constructor; where Forgather's behaviour is defined
in terms of ``args`` / ``state`` (files in ``args.logging_dir``, work at
``on_evaluate``) it is an HF-dialect :class:`TrainerCallback` reusing native
helpers. The native classes in :mod:`hookloop.callbacks` keep their own
signatures. ``TrainerControlCallback`` is in :mod:`hookloop.control.server`.

One module per callback or family, each name importable from here too:

- ``metrics``: ``DefaultMetrics``; ``info``: ``InfoCallback``;
  ``progress``: ``ProgressCallback`` and its final summary;
- ``divergence``: ``DivergenceDetector`` (and its older names);
- ``norms``: ``WeightNormLogger``, ``GradNormLogger``, ``ParameterNormLogger``;
- ``jsonlog``: ``JsonLogger`` and the resumable ``JsonArrayFile`` it writes through;
- ``tensorboard``: ``ResumableSummaryWriter``, ``TBLogger``;
- ``memory``: ``PeakMemory``; ``profiler``: ``ProfilerCallback``;
  ``textgen``: ``TextgenCallback``;
- ``common``: the argument checks and the logger they share.
"""

from __future__ import annotations

# The tables and functions the callbacks are built from stay importable from here
# ("X as X"); __all__ lists the callbacks.
from hookloop.compat.forgather.callbacks.common import log as log
from hookloop.compat.forgather.callbacks.divergence import (
    DivergenceDetector,
    DualTimeScaleDivergenceDetector,
    DualWindowDivergenceDetector,
)
from hookloop.compat.forgather.callbacks.info import InfoCallback
from hookloop.compat.forgather.callbacks.jsonlog import JsonArrayFile as JsonArrayFile
from hookloop.compat.forgather.callbacks.jsonlog import JsonLogger
from hookloop.compat.forgather.callbacks.jsonlog import read_json_log as read_json_log
from hookloop.compat.forgather.callbacks.memory import PeakMemory
from hookloop.compat.forgather.callbacks.metrics import DefaultMetrics
from hookloop.compat.forgather.callbacks.norms import (
    GradNormLogger,
    ParameterNormLogger,
    WeightNormLogger,
)
from hookloop.compat.forgather.callbacks.profiler import ProfilerCallback
from hookloop.compat.forgather.callbacks.progress import (
    DEFAULT_FINAL_METRICS as DEFAULT_FINAL_METRICS,
)
from hookloop.compat.forgather.callbacks.progress import ProgressCallback
from hookloop.compat.forgather.callbacks.progress import (
    format_final_metrics as format_final_metrics,
)
from hookloop.compat.forgather.callbacks.progress import (
    resolve_final_metrics as resolve_final_metrics,
)
from hookloop.compat.forgather.callbacks.tensorboard import (
    DEFAULT_TB_SCALARS as DEFAULT_TB_SCALARS,
)
from hookloop.compat.forgather.callbacks.tensorboard import ResumableSummaryWriter, TBLogger
from hookloop.compat.forgather.callbacks.tensorboard import (
    default_tb_scalars as default_tb_scalars,
)
from hookloop.compat.forgather.callbacks.tensorboard import get_perplexity as get_perplexity
from hookloop.compat.forgather.callbacks.tensorboard import (
    resolve_tb_scalars as resolve_tb_scalars,
)
from hookloop.compat.forgather.callbacks.textgen import DEFAULT_GENERATION as DEFAULT_GENERATION
from hookloop.compat.forgather.callbacks.textgen import TextgenCallback
from hookloop.diloco.callback import DiLoCoCallback

__all__ = [
    "DefaultMetrics",
    "DiLoCoCallback",
    "DivergenceDetector",
    "DualTimeScaleDivergenceDetector",
    "DualWindowDivergenceDetector",
    "GradNormLogger",
    "InfoCallback",
    "JsonLogger",
    "ParameterNormLogger",
    "PeakMemory",
    "ProfilerCallback",
    "ProgressCallback",
    "ResumableSummaryWriter",
    "TBLogger",
    "TextgenCallback",
    "WeightNormLogger",
]
