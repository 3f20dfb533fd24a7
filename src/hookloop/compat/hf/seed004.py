"""Deprecated home of Forgather's built-ins: use :mod:`hookloop.compat.forgather`.

Kept for one release; importing it warns. Every name is the one in
:mod:`hookloop.compat.forgather.callbacks`, looked up on first use.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

warnings.warn(
    "hookloop.compat.hf.seed004 moved to hookloop.compat.forgather; the old path goes away "
    "in the next release",
    DeprecationWarning,
    stacklevel=2,
)

_NAMES = (
    "DefaultMetrics",
    "DiLoCoCallback",
    "DivergenceDetector",
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
)
__all__ = list(_NAMES)  # resolved by __getattr__ below


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module("hookloop.compat.forgather.callbacks"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
