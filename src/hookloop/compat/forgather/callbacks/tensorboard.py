"""Forgather's TensorBoard parts: ``ResumableSummaryWriter``, and ``TBLogger`` with its
scalar table (tag -> source metric and transform)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hookloop.callbacks import progress as _progress
from hookloop.callbacks import tensorboard as _tensorboard
from hookloop.compat.forgather.callbacks.common import check_writer, log, markdown_block
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.compat.hf.callback import TrainerCallback

__all__ = [
    "DEFAULT_TB_SCALARS",
    "ResumableSummaryWriter",
    "TBLogger",
    "default_tb_scalars",
    "get_perplexity",
    "resolve_tb_scalars",
]


@answers_transformers_events
class ResumableSummaryWriter(_tensorboard.ResumableSummaryWriter):
    """``ResumableSummaryWriter(log_dir)``: a lazily opened writer that purges on resume.

    Takes ``SummaryWriter``'s own call shapes (``global_step=``), so it can be
    handed to any Forgather callback that expects a ``SummaryWriter``.
    """

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume into the directory the checkpointed run wrote to, when it still exists."""
        original = state.get("log_dir")
        if original and os.path.isdir(original) and Path(original) != self.log_dir:
            log.info("ResumableSummaryWriter: resuming into %s", original)
            self.close()
            self.log_dir = Path(original)
        elif original and not os.path.isdir(original):
            log.warning(
                "ResumableSummaryWriter: the checkpointed run's %s is gone; writing to %s",
                original,
                self.log_dir,
            )

    def add_scalar(  # type: ignore[override]
        self, tag: str, scalar_value: Any, global_step: int | None = None, **kwargs: Any
    ) -> None:
        if self.enabled:
            self.writer.add_scalar(tag, scalar_value, global_step=global_step, **kwargs)

    def add_text(  # type: ignore[override]
        self, tag: str, text_string: str, global_step: int | None = None, **kwargs: Any
    ) -> None:
        if self.enabled:
            self.writer.add_text(tag, text_string, global_step=global_step, **kwargs)


def get_perplexity(value: Any, metrics: Mapping[str, Any]) -> float:
    """``exp(value)`` (``inf`` past a float's range): Forgather's ``eval-perplexity`` transform."""
    try:
        return math.exp(value)
    except OverflowError:
        return float("inf")


#: Forgather's default TensorBoard scalars: tag -> ``{source, transform}``; a missing
#: ``source`` is the tag with ``-`` read as ``_`` (``learning-rate`` <- ``learning_rate``).
DEFAULT_TB_SCALARS: dict[str, dict[str, Any]] = {
    "train-loss": {"source": "loss"},
    "learning-rate": {},
    "grad-norm": {},
    "eval-loss": {},
    "eval-perplexity": {"source": "eval_loss", "transform": get_perplexity},
}


def default_tb_scalars() -> dict[str, dict[str, Any]]:
    """A fresh copy of :data:`DEFAULT_TB_SCALARS` (Forgather's function of that name)."""
    return {tag: dict(spec) for tag, spec in DEFAULT_TB_SCALARS.items()}


def _check_spec(tag: Any, spec: Any) -> dict[str, Any]:
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"scalars keys must be non-empty TensorBoard tags, got {tag!r}")
    if not isinstance(spec, Mapping) or set(spec) - {"source", "transform"}:
        raise ValueError(
            f"scalars[{tag!r}] must be None or a dict with source and/or transform, got {spec!r}"
        )
    source = spec.get("source")
    if source is not None and not isinstance(source, str):
        raise ValueError(f"scalars[{tag!r}]['source'] must be a metric name, got {source!r}")
    transform = spec.get("transform")
    if transform is not None and not callable(transform):
        raise ValueError(
            f"scalars[{tag!r}]['transform'] must be callable(value, metrics), got {transform!r}"
        )
    return dict(spec)


def resolve_tb_scalars(overrides: Any) -> dict[str, dict[str, Any]]:
    """Forgather's scalars: ``{tag: {source, transform}}``, resolved.

    A dict is merged into the defaults as Forgather merges it: ``None`` removes a
    tag, a dict updates that tag's fields (a new tag is added), and a tag without
    a ``source`` reads the metric named like the tag with ``-`` as ``_``. Forgather's
    older form, a list of ``(metric, tag)`` or ``(metric, tag, transform)``, replaces
    the defaults.
    """
    if overrides is None:
        overrides = {}
    if isinstance(overrides, (list, tuple)):
        merged: dict[str, dict[str, Any]] = {}
        for item in overrides:
            if (
                not isinstance(item, (list, tuple))
                or len(item) not in (2, 3)
                or not all(isinstance(x, str) for x in item[:2])
            ):
                raise ValueError(
                    "scalars as a list holds (metric, tag) or (metric, tag, transform) tuples, "
                    f"got {item!r}"
                )
            spec = {"source": item[0]} | ({"transform": item[2]} if len(item) == 3 else {})
            merged[item[1]] = _check_spec(item[1], spec)
        return merged
    if not isinstance(overrides, Mapping):
        raise ValueError(
            "scalars must be a dict of tag -> {source, transform} (or None to remove one), a "
            f"list of (metric, tag[, transform]) tuples, or None; got {overrides!r}"
        )
    merged = default_tb_scalars()
    for tag, spec in overrides.items():
        if spec is None:
            merged.pop(tag, None)
            continue
        merged[tag] = merged.get(tag, {}) | _check_spec(tag, spec)
    for tag, spec in merged.items():
        if not spec.get("source"):
            spec["source"] = tag.replace("-", "_")
    return merged


@answers_transformers_events
class TBLogger(TrainerCallback):
    """``TBLogger(summary_writer, scalars=None, experiment_info=None)``.

    Writes the ``experiment`` and ``training_info`` texts at train start, the
    configured scalars at every log and evaluation (Forgather's tags: ``train-loss``,
    ``learning-rate``, ``grad-norm``, ``eval-loss``, ``eval-perplexity``; see
    :func:`resolve_tb_scalars`), and ``train_results`` (the last ``log_history``
    entry) at train end, through ``summary_writer``. Forgather's older form,
    ``TBLogger(summary_writer, [(metric, tag[, transform]), ...], **experiment)``,
    is taken too: the keyword arguments become the ``experiment`` text.
    """

    priority = 100

    def __init__(
        self,
        summary_writer: Any,
        scalars: dict[str, Any] | list[tuple[Any, ...]] | None = None,
        experiment_info: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.summary_writer = check_writer("summary_writer", summary_writer, optional=False)
        self.scalars = resolve_tb_scalars(scalars)
        if experiment_info is not None and not isinstance(experiment_info, Mapping):
            raise ValueError(f"experiment_info must be a dict or None, got {experiment_info!r}")
        if kwargs:  # Forgather's older TBLogger(writer, scalars, **experiment)
            experiment_info = {**(experiment_info or {}), **kwargs}
        self.experiment_info = markdown_block(experiment_info) if experiment_info else None
        self.last_step = -1

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.experiment_info is not None:
            self.summary_writer.add_text(
                "experiment", self.experiment_info, global_step=state.global_step
            )
        info = {
            "model": type(kwargs.get("model")).__name__,
            "global_step": state.global_step,
            "max_steps": state.max_steps,
            "num_train_epochs": state.num_train_epochs,
            "train_batch_size": state.train_batch_size,
            "logging_steps": state.logging_steps,
            "eval_steps": state.eval_steps,
            "learning_rate": getattr(args, "learning_rate", None),
            "output_dir": getattr(args, "output_dir", None),
            "logging_dir": getattr(args, "logging_dir", None),
        }
        self.summary_writer.add_text(
            "training_info", markdown_block(info), global_step=state.global_step
        )

    def _write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for tag, spec in self.scalars.items():
            value = metrics.get(spec["source"])
            if value is None:
                continue
            if spec.get("transform") is not None:
                value = spec["transform"](value, metrics)
                if value is None:
                    continue
            if _progress.is_number(value):
                self.summary_writer.add_scalar(tag, value, global_step=step)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero or self.last_step == state.global_step:
            return
        self.last_step = state.global_step
        self._write(state.global_step, kwargs.get("metrics") or {})

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        logs = kwargs.get("logs") or {}
        if any(key.startswith("eval_") for key in logs):
            self.last_step = state.global_step  # on_evaluate then has nothing new to write
        self._write(state.global_step, logs)
        self.summary_writer.flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not state.log_history:
            return
        self.summary_writer.add_text(
            "train_results", markdown_block(state.log_history[-1]), global_step=state.global_step
        )
        self.summary_writer.flush()
