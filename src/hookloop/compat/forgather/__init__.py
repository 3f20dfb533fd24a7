"""Forgather, reproduced: its built-in callbacks, its trainer control and its DiLoCo parts.

- :mod:`hookloop.compat.forgather.callbacks`: the built-ins (``JsonLogger``,
  ``TBLogger``, ``DivergenceDetector``, ``ProgressCallback``, ...), with
  Forgather's constructors and files; they run in the HF dialect's ``Trainer``.
- :mod:`hookloop.compat.forgather.control`: ``TrainerControlCallback`` and the client.
- :mod:`hookloop.compat.forgather.diloco`: ``DiLoCoServer``, ``DiLoCoWorker``,
  ``DiLoCoClient``, ``DiLoCoCallback`` (the implementation is :mod:`hookloop.diloco`).

The control and DiLoCo names load on first use, so importing the built-ins
does not import aiohttp or the control package.
"""

from __future__ import annotations

from typing import Any

from hookloop.compat.forgather.callbacks import (
    DefaultMetrics,
    DiLoCoCallback,
    DivergenceDetector,
    DualTimeScaleDivergenceDetector,
    DualWindowDivergenceDetector,
    GradNormLogger,
    InfoCallback,
    JsonLogger,
    ParameterNormLogger,
    PeakMemory,
    ProfilerCallback,
    ProgressCallback,
    ResumableSummaryWriter,
    TBLogger,
    TextgenCallback,
    WeightNormLogger,
)

_LAZY = {
    "TrainerControlCallback": "control",
    "JobClient": "control",
    "DiLoCoServer": "diloco",
    "DiLoCoWorker": "diloco",
    "DiLoCoClient": "diloco",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hookloop.compat.forgather' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"hookloop.compat.forgather.{module}"), name)


__all__ = [
    "DefaultMetrics",
    "DiLoCoCallback",
    "DiLoCoClient",
    "DiLoCoServer",
    "DiLoCoWorker",
    "DivergenceDetector",
    "DualTimeScaleDivergenceDetector",
    "DualWindowDivergenceDetector",
    "GradNormLogger",
    "InfoCallback",
    "JobClient",
    "JsonLogger",
    "ParameterNormLogger",
    "PeakMemory",
    "ProfilerCallback",
    "ProgressCallback",
    "ResumableSummaryWriter",
    "TBLogger",
    "TextgenCallback",
    "TrainerControlCallback",
    "WeightNormLogger",
]
