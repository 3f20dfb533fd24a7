"""The HF dialect: callbacks ``on_<event>(args, state, control, **kwargs)`` and
transformers' ``Trainer`` surface.

Callbacks written for ``transformers.Trainer`` or Forgather run unmodified on the
native loop: pass them in ``callbacks`` of :class:`Trainer` (or wrap them with
:func:`hf_callbacks` for the native ``hookloop.Trainer``). A handler's flags on
``control`` become native requests: ``should_training_stop`` a stop (with a
save), ``should_abort_without_save`` an abort, ``should_save`` /
``should_evaluate`` / ``should_log`` a save / evaluation / log at the end of
the step. The dispatch is the ``"hf"`` column of :mod:`hookloop.compat.mapping`.

Forgather's built-in callbacks (:mod:`hookloop.compat.forgather`) are importable
from here too; most are thin classes over the native ones.

>>> from hookloop.compat.hf import Trainer, TrainerCallback, TrainingArguments
>>> class StopAtTwo(TrainerCallback):
...     def on_step_end(self, args, state, control, **kwargs):
...         control.should_training_stop = state.global_step >= 2
>>> from hookloop.testing import TinyModel, ToyData
>>> import tempfile
>>> out = tempfile.mkdtemp()  # as transformers, the run directory (default ./trainer_output)
>>> args = TrainingArguments(out, per_device_train_batch_size=4, max_steps=10, logging_steps=5)
>>> trainer = Trainer(TinyModel(), args, train_dataset=ToyData(n=64),
...                   loss_fn=TinyModel.loss_fn, callbacks=[StopAtTwo()])
>>> from transformers import ProgressCallback  # the progress display is transformers' own
>>> quiet = trainer.pop_callback(ProgressCallback)  # HF's API: no progress display
>>> trainer.train().step
2
"""

from __future__ import annotations

from typing import Any

from hookloop.callback import Stateful
from hookloop.compat.hf.adapter import HFSession
from hookloop.compat.hf.callback import TrainerCallback
from hookloop.compat.hf.data import default_data_collator
from hookloop.compat.hf.evaluation import EvalLoopOutput, EvalPrediction, PredictionOutput
from hookloop.compat.hf.handler import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    PrinterCallback,
)
from hookloop.compat.hf.seq2seq import Seq2SeqTrainer
from hookloop.compat.hf.trainer import Trainer, TrainOutput
from hookloop.compat.hf.types import TrainerControl, TrainerState


def hf_callbacks(callbacks: Any, *, args: Any = None, processing_class: Any = None) -> list[Any]:
    """Native callbacks for the native ``hookloop.Trainer`` from a mixed list.

    ``args`` defaults to the trainer's Config under HF's names.
    """
    return HFSession(args, processing_class=processing_class).wrap(callbacks)


#: Forgather's built-ins, re-exported from :mod:`hookloop.compat.forgather` on first use.
_FORGATHER = frozenset(
    {
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
    }
)


def __getattr__(name: str) -> Any:
    if name in _FORGATHER:
        import importlib

        return getattr(importlib.import_module("hookloop.compat.forgather.callbacks"), name)
    if name in ("TrainingArguments", "Seq2SeqTrainingArguments"):  # transformers' (late)
        from hookloop.compat.hf import training_args

        return getattr(training_args, name)
    if name == "TrainerControlCallback":  # hookloop.control is imported only when asked for
        from hookloop.control import TrainerControlCallback

        return TrainerControlCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "DefaultMetrics",
    "DiLoCoCallback",
    "DivergenceDetector",
    "EvalLoopOutput",
    "EvalPrediction",
    "ExportableState",
    "GradNormLogger",
    "HFSession",
    "InfoCallback",
    "JsonLogger",
    "ParameterNormLogger",
    "PeakMemory",
    "PredictionOutput",
    "PrinterCallback",
    "ProfilerCallback",
    "ProgressCallback",
    "ResumableSummaryWriter",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Stateful",
    "TBLogger",
    "TextgenCallback",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerControlCallback",
    "TrainerState",
    "TrainingArguments",
    "WeightNormLogger",
    "default_data_collator",
    "hf_callbacks",
]
