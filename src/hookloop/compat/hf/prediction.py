"""``Trainer.evaluate()`` and ``Trainer.predict()`` of the HF dialect, over the loop's
evaluation: HF's evaluation (:class:`hookloop.compat.hf.parts.HFEvaluation`) is told
the ``metric_key_prefix`` and ``ignore_keys`` for one pass, and ``predict()`` keeps
its predictions; transformers' memory metrics bracket each pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hookloop.compat.hf import parts as hf_parts
from hookloop.compat.hf.adapter import HFSession
from hookloop.compat.hf.evaluation import PredictionOutput
from hookloop.compat.hf.memory import MemoryTracker


def check_prefix(metric_key_prefix: Any) -> None:
    if not isinstance(metric_key_prefix, str) or not metric_key_prefix:
        raise ValueError(f"metric_key_prefix must be a non-empty string, got {metric_key_prefix!r}")


def check_evaluate(metric_key_prefix: Any, ignore_keys: Any) -> None:
    check_prefix(metric_key_prefix)
    if ignore_keys is not None and not all(isinstance(k, str) for k in ignore_keys):
        raise ValueError(f"ignore_keys must be a list of output names, got {ignore_keys!r}")


def check_predict(test_dataset: Any, metric_key_prefix: Any) -> None:
    check_prefix(metric_key_prefix)
    if test_dataset is None:
        raise ValueError("predict() needs a test_dataset")


def evaluate_each(
    evaluate_one: Callable[..., dict[str, float]],
    sets: Mapping[str, Any],
    given: bool,
    ignore_keys: list[str] | None,
    prefix: str,
) -> dict[str, float]:
    """A dict of evaluation datasets, each evaluated by ``evaluate_one`` (the Trainer's
    ``evaluate``, a subclass's override included) with its keys prefixed with its name;
    the trainer's own sets go by name (``given`` False), so their loaders are reused."""
    metrics: dict[str, float] = {}
    for name, one in sets.items():
        chosen = one if given else name
        metrics.update(evaluate_one(chosen, ignore_keys, f"{prefix}_{name}"))
    return metrics


def evaluate(
    loop: Any,
    loader: Callable[[], Iterable[Any]],
    session: HFSession,
    memory: MemoryTracker,
    prefix: str,
    ignore_keys: list[str] | None,
) -> dict[str, float]:
    """One evaluation of ``loader()``'s batches, its keys starting with ``prefix``; with
    HF's flow, the epoch added as HF's ``log()`` adds it to what ``evaluate`` returns."""
    memory.start("eval")
    evaluation = loop.evaluation
    hf_evaluation = isinstance(evaluation, hf_parts.HFEvaluation)
    if hf_evaluation:
        evaluation.prefix, evaluation.ignore_keys = prefix, ignore_keys
    try:
        metrics = loop.evaluate(loader())
    finally:
        if hf_evaluation:
            evaluation.prefix = evaluation.ignore_keys = None
    if session.drives_loop:
        metrics["epoch"] = session.state.epoch
    memory.stop_and_update("eval", metrics)
    return metrics


def predict(
    loop: Any,
    loader: Iterable[Any],
    memory: MemoryTracker,
    prefix: str,
    ignore_keys: list[str] | None,
) -> Any:
    """HF's ``predict``: a :class:`PredictionOutput` of the predictions, the labels and
    the metrics, firing ``on_predict``; with a native step, the native ``predict()``."""
    evaluation = loop.evaluation
    if not isinstance(evaluation, hf_parts.HFEvaluation):
        return loop.predict(loader)
    evaluation.prefix, evaluation.ignore_keys = prefix, ignore_keys
    evaluation.keep_predictions = True
    memory.start("test")
    try:
        metrics = loop.test(loader)
    finally:
        evaluation.prefix = evaluation.ignore_keys = None
        evaluation.keep_predictions = False
    memory.stop_and_update("test", metrics)
    collected, evaluation.last = evaluation.last, None
    predictions, label_ids = collected.predictions() if collected else (None, None)
    return PredictionOutput(predictions, label_ids, metrics)
