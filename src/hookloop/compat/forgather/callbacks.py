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
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookloop.callbacks import divergence as _divergence
from hookloop.callbacks import info as _info
from hookloop.callbacks import metrics as _metrics
from hookloop.callbacks import norms as _norms
from hookloop.callbacks import profiler as _profiler
from hookloop.callbacks import progress as _progress
from hookloop.callbacks import tensorboard as _tensorboard
from hookloop.callbacks.norms import spectral_norm
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.compat.hf.callback import TrainerCallback
from hookloop.diloco.callback import DiLoCoCallback
from hookloop.state import CallbackContext

log = logging.getLogger("hookloop.compat.hf")

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


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _positive_int(name: str, value: Any, *, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an int >= 1 or None" if optional else "an int >= 1"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def _check_writer(name: str, writer: Any, *, optional: bool) -> Any:
    if writer is None and optional:
        return None
    if not callable(getattr(writer, "add_scalar", None)) or not callable(
        getattr(writer, "add_text", None)
    ):
        allowed = "a SummaryWriter-like object (add_scalar, add_text)"
        raise ValueError(
            f"{name} must be {allowed}{' or None' if optional else ''}, got {writer!r}"
        )
    return writer


def _markdown(mapping: Mapping[str, Any]) -> str:
    """TensorBoard renders text as markdown: a code block keeps the columns aligned."""
    return "```\n" + _info.format_info(dict(mapping)) + "\n```"


# -- metrics, progress and run info ----------------------------------------------------


@answers_transformers_events
class DefaultMetrics(_metrics.DefaultMetrics):
    """``DefaultMetrics(peak_hardware_flops=None)``: throughput and MFU in every log.

    The native producer under Forgather's constructor. It also copies a
    ``peak_mem_allocated`` log entry to ``peak_mem``, as Forgather does.
    """

    def __init__(self, peak_hardware_flops: float | None = None) -> None:
        super().__init__(peak_hardware_flops=peak_hardware_flops)

    def on_before_log(self, ctx: CallbackContext) -> None:
        super().on_before_log(ctx)
        peak = ctx.logs.get("peak_mem_allocated") if ctx.logs is not None else None
        if peak is not None:
            ctx.logs["peak_mem"] = peak


#: Forgather's end-of-training summary: key -> (label, format spec, suffix).
DEFAULT_FINAL_METRICS: dict[str, dict[str, str]] = {
    "train_runtime": {"label": "runtime", "fmt": ".2f", "suffix": " s"},
    "train_samples_per_second": {"label": "samples/s", "fmt": ".3g", "suffix": ""},
    "train_steps_per_second": {"label": "steps/s", "fmt": ".3g", "suffix": ""},
    "total_flos": {"label": "total FLOPs", "fmt": ".3g", "suffix": ""},
    "train_loss": {"label": "train loss", "fmt": ".4g", "suffix": ""},
    "epoch": {"label": "epoch", "fmt": ".2f", "suffix": ""},
}


def resolve_final_metrics(overrides: Any) -> dict[str, dict[str, str]]:
    """The defaults merged with ``overrides`` (``None`` for a key removes it)."""
    merged = {k: dict(v) for k, v in DEFAULT_FINAL_METRICS.items()}
    if overrides is None:
        return merged
    if not isinstance(overrides, Mapping):
        raise ValueError(
            f"final_metrics must be a dict of metric -> {{label, fmt, suffix}} or None, "
            f"got {overrides!r}"
        )
    for key, spec in overrides.items():
        if spec is None:
            merged.pop(key, None)
            continue
        if not isinstance(spec, Mapping) or set(spec) - {"label", "fmt", "suffix"}:
            raise ValueError(
                f"final_metrics[{key!r}] must be None or a dict with label, fmt, suffix; "
                f"got {spec!r}"
            )
        merged[key] = {"label": key, "fmt": "", "suffix": ""} | merged.get(key, {}) | dict(spec)
    return merged


def format_final_metrics(logs: Mapping[str, Any], specs: Mapping[str, Mapping[str, str]]) -> str:
    """One line: ``label value+suffix`` for each final metric present in ``logs``."""
    parts = []
    for key, spec in specs.items():
        value = logs.get(key)
        if value is None:
            continue
        text = format(value, spec.get("fmt", "")) if _progress.is_number(value) else str(value)
        parts.append(f"{spec.get('label', key)} {text}{spec.get('suffix', '')}")
    return "training finished: " + ", ".join(parts)


@answers_transformers_events
class ProgressCallback(_progress.ProgressBar):
    """Progress, a metric table and a final summary; Forgather's and transformers' constructor.

    ``ProgressCallback(use_tqdm, output_stream, step_columns, final_metrics,
    header_interval)`` as in Forgather (``output_stream`` defaults to stdout), and
    ``ProgressCallback()`` / ``ProgressCallback(max_str_len=100)`` as in
    transformers, and Forgather's older form with ``show_loss``, ``show_grad_norm``,
    ``show_learning_rate``, ``show_tokens``, ``show_epoch``, ``show_tokens_per_second``,
    ``peak_hardware_flops`` and ``show_peak_memory`` (positional or by name), which
    choose the columns. A log holding ``train_runtime`` is shown as the final summary
    instead of a row; when the run logs none, the summary is printed at train
    end from the run's own clock and counters.
    """

    def __init__(
        self,
        use_tqdm: bool | None = None,
        output_stream: Any = None,
        step_columns: dict[str, Any] | None = None,
        final_metrics: dict[str, Any] | None = None,
        header_interval: int = 20,
        *older: Any,
        max_str_len: int = 100,
        **flags: Any,
    ) -> None:
        if isinstance(step_columns, bool) or flags or older:
            # Forgather's older form: (use_tqdm, output_stream, show_loss, show_grad_norm,
            # show_learning_rate, show_tokens, show_epoch, show_tokens_per_second,
            # peak_hardware_flops, show_peak_memory, header_interval)
            step_columns, header_interval = _older_progress_form(
                step_columns, final_metrics, header_interval, older, flags
            )
            final_metrics = None
        if step_columns is not None and not isinstance(step_columns, Mapping):
            raise ValueError(
                f"step_columns must be a dict of metric -> {{label, width, fmt}} or None, "
                f"got {step_columns!r}"
            )
        if isinstance(output_stream, str) and output_stream not in ("stdout", "stderr"):
            raise ValueError(f"Must be one of 'stderr' or 'stdout', got {output_stream!r}")
        super().__init__(
            step_columns,
            stream="stdout" if output_stream is None else output_stream,
            use_tqdm=use_tqdm,
            header_every=_positive_int("header_interval", header_interval),
        )
        self.final_metrics = resolve_final_metrics(final_metrics)
        self.max_str_len = _positive_int("max_str_len", max_str_len)
        self._summary_shown = False
        self._t0 = 0.0
        self._step0 = 0
        self._samples0 = 0
        self._last_loss: float | None = None

    def on_train_start(self, ctx: CallbackContext) -> None:
        super().on_train_start(ctx)
        self._summary_shown = False
        self._t0 = time.monotonic()
        self._step0, self._samples0 = ctx.state.step, ctx.state.samples

    def on_log(self, ctx: CallbackContext) -> None:
        logs = ctx.logs or {}
        if "train_runtime" in logs:
            if ctx.state.is_rank_zero:
                self._summary(logs)
            return
        if _progress.is_number(logs.get("loss")):
            self._last_loss = float(logs["loss"])
        super().on_log(ctx)

    def on_train_end(self, ctx: CallbackContext) -> None:
        if ctx.state.is_rank_zero and not self._summary_shown:
            st = ctx.state
            runtime = max(time.monotonic() - self._t0, 1e-9)
            final: dict[str, Any] = {
                "train_runtime": runtime,
                "train_samples_per_second": (st.samples - self._samples0) / runtime,
                "train_steps_per_second": (st.step - self._step0) / runtime,
                "epoch": st.epoch
                + (st.epoch_step / st.steps_per_epoch if st.steps_per_epoch else 0),
            }
            if st.flops:
                final["total_flos"] = float(st.flops)
            if self._last_loss is not None:
                final["train_loss"] = self._last_loss
            self._summary(final)
        super().on_train_end(ctx)

    def _summary(self, logs: Mapping[str, Any]) -> None:
        self._summary_shown = True
        self._write(format_final_metrics(logs, self.final_metrics))


#: Forgather's older ProgressCallback parameters after output_stream, in order.
_OLDER_PROGRESS = (
    "show_loss",
    "show_grad_norm",
    "show_learning_rate",
    "show_tokens",
    "show_epoch",
    "show_tokens_per_second",
    "peak_hardware_flops",
    "show_peak_memory",
    "header_interval",
)
_OLDER_DEFAULTS: dict[str, Any] = dict.fromkeys(_OLDER_PROGRESS[:6], True) | {
    "peak_hardware_flops": None,
    "show_peak_memory": True,
    "header_interval": 20,
}


def _older_progress_form(
    third: Any, fourth: Any, fifth: Any, rest: tuple[Any, ...], flags: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """The step columns and header interval Forgather's older ProgressCallback arguments ask for."""
    given: dict[str, Any] = {}
    if isinstance(third, bool):  # positional: show_loss, show_grad_norm, ...
        positional = [third, fourth, fifth, *rest]
        if len(positional) > len(_OLDER_PROGRESS):
            raise TypeError(
                f"ProgressCallback takes at most {len(_OLDER_PROGRESS) + 2} positional "
                f"arguments in Forgather's older form, got {len(positional) + 2}"
            )
        given = dict(zip(_OLDER_PROGRESS, positional, strict=False))
        if not rest:  # slots 4 and 5 hold the newer form's defaults when not given
            if fourth is None:
                del given["show_grad_norm"]
            if fifth == 20 and not isinstance(fifth, bool):
                del given["show_learning_rate"]
    elif rest or third is not None or fourth is not None:
        raise TypeError(
            "ProgressCallback takes (use_tqdm, output_stream, step_columns, final_metrics, "
            "header_interval) or Forgather's older (use_tqdm, output_stream, show_loss, ...): "
            "not a mix of the two"
        )
    else:
        given["header_interval"] = fifth
    unknown = sorted(set(flags) - set(_OLDER_PROGRESS))
    if unknown:
        raise TypeError(
            f"ProgressCallback got an unexpected keyword argument {unknown[0]!r}; the older "
            f"form takes {', '.join(_OLDER_PROGRESS)}"
        )
    twice = sorted(set(flags) & set(given) - {"header_interval"})
    if twice:
        raise TypeError(f"ProgressCallback got multiple values for argument {twice[0]!r}")
    values = _OLDER_DEFAULTS | given | flags
    for name in (*_OLDER_PROGRESS[:6], "show_peak_memory"):
        _flag(name, values[name])
    peak = values["peak_hardware_flops"]
    if peak is not None and (
        isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0
    ):
        raise ValueError(f"peak_hardware_flops must be a FLOP/s figure > 0 or None, got {peak!r}")
    columns: dict[str, Any] = {}
    if not values["show_loss"]:
        columns["loss"] = None
    if not values["show_grad_norm"]:
        columns["grad_norm"] = None
    if not values["show_learning_rate"]:
        columns["lr"] = columns["learning_rate"] = None
    if values["show_tokens"]:
        columns["tokens"] = {"label": "tokens", "fmt": ",.0f"}
    if values["show_epoch"]:
        columns["epoch"] = {"label": "epoch", "fmt": ".2f"}
    if not values["show_tokens_per_second"]:
        columns["tok_per_sec"] = None
    if not values["show_peak_memory"]:
        columns["peak_mem_mib"] = None
    if peak is not None:
        log.warning(
            "ProgressCallback(peak_hardware_flops=...) is Forgather's older form: the mfu "
            "column shows what DefaultMetrics(peak_hardware_flops=%g) logs",
            peak,
        )
    return columns, values["header_interval"]


@answers_transformers_events
class WeightNormLogger(_norms.WeightNormLogger):
    """The L2 norm of all parameters together.

    ``WeightNormLogger()``: as ``weight_norm`` in every log, as Forgather does now.
    Forgather's older ``WeightNormLogger(summary_writer, tag="weight_norm")`` writes
    it to that writer under ``tag`` at each evaluation instead (rank 0). hookloop's
    ``include=`` (parameter-name prefixes) and ``key=`` work in the first form.
    """

    def __init__(
        self,
        summary_writer: Any = None,
        tag: str = "weight_norm",
        *,
        include: Any = None,
        key: str = "weight_norm",
    ) -> None:
        if summary_writer is not None and not callable(getattr(summary_writer, "add_scalar", None)):
            if include is not None:
                raise ValueError(
                    "WeightNormLogger takes a summary_writer (Forgather's older form) or "
                    f"include=, got both: {summary_writer!r} and include={include!r}"
                )
            include, summary_writer = summary_writer, None  # hookloop's include, given first
        super().__init__(include, key=key)
        self.summary_writer = _check_writer("summary_writer", summary_writer, optional=True)
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty TensorBoard tag, got {tag!r}")
        self.tag = tag
        self.warned_meta = False

    def on_before_log(self, ctx: CallbackContext) -> None:
        if self.summary_writer is None:
            super().on_before_log(ctx)

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if self.summary_writer is None or not ctx.state.is_rank_zero or ctx.model is None:
            return
        params = [p.detach() for p in ctx.model.parameters()]
        if not params or any(p.device.type == "meta" for p in params):
            if not self.warned_meta:
                log.warning(
                    "WeightNormLogger: the model's parameters are on the meta device (a "
                    "pipeline stage's shell); the weight norm is not logged"
                )
                self.warned_meta = True
            return
        with torch.no_grad():
            norms = torch.stack([torch.linalg.vector_norm(p.float()).cpu() for p in params])
            total = float(torch.linalg.vector_norm(norms))
        self.summary_writer.add_scalar(self.tag, total, global_step=ctx.state.step)
        flush = getattr(self.summary_writer, "flush", None)
        if callable(flush):
            flush()


@answers_transformers_events
class InfoCallback(_info.InfoCallback):
    """``InfoCallback(verbose=False)``: the run summary on stdout at train start (rank 0)."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__("stdout", verbose=_flag("verbose", verbose))


@answers_transformers_events
class DivergenceDetector(_divergence.DivergenceDetector):
    """The native detector under Forgather's positional order (``action`` third from last)."""

    def __init__(
        self,
        smoothing: float = 0.3,
        threshold: float | None = 1.0,  # an absolute rise over the best smoothed value
        relative_threshold: float | None = None,  # or a factor of it
        patience: int = 3,
        warmup: int = 10,
        action: str = "stop",
        use_eval_loss: bool = False,
        metric_key: str | None = None,
    ) -> None:
        _check_divergence_numbers(smoothing, threshold, relative_threshold, patience, warmup)
        super().__init__(
            smoothing,
            threshold=threshold,
            relative_threshold=relative_threshold,
            patience=patience,
            warmup=warmup,
            metric_key=metric_key,
            use_eval_loss=use_eval_loss,
            action=action,  # type: ignore[arg-type]
        )

    def hf_on_log(
        self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
    ) -> Any:
        """Forgather's ``on_log`` called directly: the watched value feeds the detector."""
        return self._observe_directly(state, control, logs)

    def hf_on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> Any:
        """Forgather's ``on_evaluate`` called directly: the watched value feeds the detector."""
        return self._observe_directly(state, control, metrics)

    def _observe_directly(self, state: Any, control: Any, values: Any) -> Any:
        """A divergence sets ``control.should_training_stop`` (and, for ``action="abort"``,
        ``should_abort_without_save`` where the control has it), as Forgather's does."""
        value = (values or {}).get(self.key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return control
        why = self.tracker.update(value)
        if why is None:
            return control
        self.triggered = why
        if getattr(state, "is_world_process_zero", True):
            log.error("divergence: %s %s; action: %s", self.key, why, self.action)
        control.should_training_stop = True
        if self.action == "abort" and hasattr(control, "should_abort_without_save"):
            control.should_abort_without_save = True
        return control

    def state_dict(self) -> dict[str, Any]:
        """Forgather's keys (``smoothed_loss``, ``best_smoothed_loss``, ``observation_count``,
        ``consecutive_above``), so a checkpoint resumes on either side; plus hookloop's
        ``healthy_step``."""
        native = super().state_dict()
        return {
            "smoothed_loss": native["smoothed"],
            "best_smoothed_loss": native["best"],
            "observation_count": native["observations"],
            "consecutive_above": native["consecutive"],
            "healthy_step": native.get("healthy_step", 0),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Forgather's keys, or the native ones an older hookloop checkpoint holds."""
        if not isinstance(state, Mapping):
            raise ValueError(f"DivergenceDetector state must be a dict, got {state!r}")
        if "smoothed" in state:  # written before the keys were Forgather's
            super().load_state_dict(dict(state))
            return
        missing = [k for k in _DIVERGENCE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"DivergenceDetector state lacks {', '.join(missing)}; it holds "
                f"{', '.join(map(str, state)) or 'nothing'} "
                f"(expected {', '.join(_DIVERGENCE_KEYS)})"
            )
        super().load_state_dict(
            {
                "smoothed": state["smoothed_loss"],
                "best": state["best_smoothed_loss"],
                "observations": state["observation_count"],
                "consecutive": state["consecutive_above"],
                "healthy_step": state.get("healthy_step", 0),
            }
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_divergence_numbers(
    smoothing: Any, threshold: Any, relative_threshold: Any, patience: Any, warmup: Any
) -> None:
    """Forgather's range checks, with its messages (other mistakes get the native ones)."""
    if _is_number(smoothing) and not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
    if _is_number(threshold) and threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    if _is_number(relative_threshold) and relative_threshold <= 1:
        raise ValueError(f"relative_threshold must be > 1, got {relative_threshold}")
    if threshold is None and relative_threshold is None:
        raise ValueError("At least one of threshold or relative_threshold must be set")
    if _is_number(patience) and patience < 1:
        raise ValueError(f"patience must be >= 1, got {patience}")
    if _is_number(warmup) and warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


_DIVERGENCE_KEYS = ("smoothed_loss", "best_smoothed_loss", "observation_count", "consecutive_above")

#: Forgather keeps its older detectors' names for :class:`DivergenceDetector`.
DualTimeScaleDivergenceDetector = DivergenceDetector
DualWindowDivergenceDetector = DivergenceDetector


@answers_transformers_events
class ProfilerCallback(_profiler.ProfilerCallback):
    """``ProfilerCallback(start_step=3, num_steps=5, output_dir="benchmarks/profiles", ...)``.

    The native profiler over Forgather's window (the ``num_steps`` steps after
    ``start_step``) with Forgather's outputs: every rank writes its Chrome trace to
    ``<output_dir>/real_training_rank<R>.json``, and rank 0 prints the operator tables
    (by total CPU time, and by total CUDA time on a GPU) to stdout.
    """

    #: Where Forgather's profiler writes unless told otherwise.
    DEFAULT_DIR = "benchmarks/profiles"

    def __init__(
        self,
        start_step: int = 3,
        num_steps: int = 5,
        output_dir: str = DEFAULT_DIR,
        with_stack: bool = True,
        with_flops: bool = True,
        record_shapes: bool = True,
    ) -> None:
        super().__init__(
            output_dir=output_dir,
            with_stack=with_stack,
            with_flops=with_flops,
            record_shapes=record_shapes,
            start_step=start_step,
            num_steps=num_steps,
            ranks=None,
        )

    def write_window(
        self, prof: Any, directory: Path, step: int, rank: int, cuda: bool
    ) -> list[Path]:
        trace = directory / f"real_training_rank{rank}.json"
        prof.export_chrome_trace(str(trace))
        log.info("ProfilerCallback: trace saved to %s", trace)
        if rank == 0:
            first = step - self.active + 1
            rule = "=" * 80
            for device, key in [("CPU", "cpu_time_total")] + (
                [("CUDA", "cuda_time_total")] if cuda else []
            ):
                table = prof.key_averages().table(sort_by=key, row_limit=self.row_limit)
                print(f"\n{rule}\n{device} time summary (steps {first}-{step}):\n{rule}")
                print(table, flush=True)
        return [trace]


# -- TensorBoard -----------------------------------------------------------------------


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
        self.summary_writer = _check_writer("summary_writer", summary_writer, optional=False)
        self.scalars = resolve_tb_scalars(scalars)
        if experiment_info is not None and not isinstance(experiment_info, Mapping):
            raise ValueError(f"experiment_info must be a dict or None, got {experiment_info!r}")
        if kwargs:  # Forgather's older TBLogger(writer, scalars, **experiment)
            experiment_info = {**(experiment_info or {}), **kwargs}
        self.experiment_info = _markdown(experiment_info) if experiment_info else None
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
            "training_info", _markdown(info), global_step=state.global_step
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
            "train_results", _markdown(state.log_history[-1]), global_step=state.global_step
        )
        self.summary_writer.flush()


# -- JSON-array logs in args.logging_dir -------------------------------------------------


def read_json_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-array log, also while it is still open (no closing ``]``)."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if not text:
        return []
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        records = json.loads(text.rstrip(",\n ") + "\n]")
    if not isinstance(records, list):
        raise ValueError(f"{path} is not a JSON array of records")
    return records


class JsonArrayFile:
    """One JSON array of records in a directory, appended as training goes.

    Each record is ``{"timestamp", "global_step", "epoch", ...}``; the array is
    closed at :meth:`close`. On resume the file is reopened, records after the
    checkpoint's step are dropped, and appending goes on.
    """

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.path: str | None = None
        self._file: Any = None
        self._prefix = ""
        self.last_step = -1
        self._resume_path: str | None = None
        self._resume_step: int | None = None

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def open(self, directory: str) -> None:
        if self._resume_path and os.path.isfile(self._resume_path):
            self.path = self._resume_path
            self._reopen_truncated()
            return
        if self._resume_path:
            log.warning(
                "%s: the log of the checkpointed run (%s) is gone; starting %s afresh",
                self.filename,
                self._resume_path,
                directory,
            )
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, self.filename)
        try:
            self._file = open(self.path, "x", encoding="utf-8")  # noqa: SIM115 - closed at close()
        except FileExistsError:
            raise FileExistsError(
                f"{self.path} exists already: give each run its own logging_dir "
                "(or resume the run that wrote it)"
            ) from None
        self._file.write("[\n")
        self._prefix = ""

    def write(self, step: int, epoch: float, data: Mapping[str, Any]) -> None:
        head = {"timestamp": time.time(), "global_step": step, "epoch": epoch}
        self._file.write(self._prefix + json.dumps(head | dict(data), default=_jsonable))
        self._file.flush()
        self._prefix = ",\n"
        self.last_step = step

    def close(self) -> None:
        if self._file is not None:
            self._file.write("\n]\n")
            self._file.close()
            self._file = None

    def state_dict(self) -> dict[str, Any]:
        return {"log_path": self.path, "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._resume_path = state.get("log_path")
        self._resume_step = state.get("last_step", -1)

    def _reopen_truncated(self) -> None:
        assert self.path is not None
        step = self._resume_step if self._resume_step is not None else -1
        try:
            kept = [r for r in read_json_log(self.path) if r.get("global_step", 0) <= step]
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            backup = self.path + ".bak"
            log.warning("%s unreadable (%s); moved to %s, starting afresh", self.path, err, backup)
            os.replace(self.path, backup)
            kept = []
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed at close()
        self._file.write("[\n")
        self._prefix = ""
        for record in kept:
            self._file.write(self._prefix + json.dumps(record))
            self._prefix = ",\n"
        self._file.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


@answers_transformers_events
class JsonLogger(TrainerCallback):
    """``JsonLogger(**kwargs)``: every log and evaluation in ``<logging_dir>/trainer_logs.json``.

    A JSON array of ``{timestamp, global_step, epoch, **values}``, one record per
    log and evaluation and nothing else: ``kwargs`` are kept (``self.kwargs``) and
    never written, as in Forgather. Nothing is written when ``args.logging_dir`` is unset.
    Resumable: a resumed run continues the same file without the records after the
    checkpoint.
    """

    priority = 100

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self._file = JsonArrayFile("trainer_logs.json")

    @property
    def log_path(self) -> str | None:
        return self._file.path

    def state_dict(self) -> dict[str, Any]:
        return self._file.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._file.load_state_dict(state)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero or getattr(args, "logging_dir", None) is None:
            return
        self._file.open(args.logging_dir)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._file.is_open:
            self._file.write(state.global_step, state.epoch, kwargs.get("logs") or {})

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._file.is_open:
            self._file.write(state.global_step, state.epoch, kwargs.get("metrics") or {})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._file.close()

    def close(self) -> None:
        self._file.close()


def _real_parameters(model: Any, who: str, warned: list[bool]) -> list[tuple[str, Any]] | None:
    """The named parameters, or None (warning once) for a pipeline stage's meta shell."""
    if model is None:
        return None
    params = list(model.named_parameters())
    if not params or params[0][1].device.type == "meta":
        if not warned[0]:
            log.warning("%s: the model's parameters are on the meta device; not logging", who)
            warned[0] = True
        return None
    return params


class _NormsFile(TrainerCallback):
    """A norm logger's JSON array file in ``args.logging_dir``: opened at train start on
    the main process, resumable (records after the checkpoint are dropped)."""

    LOG_FILENAME = ""
    _file: JsonArrayFile

    def state_dict(self) -> dict[str, Any]:
        return {"writer": self._file.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._file.load_state_dict(state.get("writer", {}))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and getattr(args, "logging_dir", None) is not None:
            self._file.open(args.logging_dir)


@answers_transformers_events
class GradNormLogger(_NormsFile):
    """``GradNormLogger()``: per-parameter gradient norms in ``<logging_dir>/gradient_norms.json``.

    The norms of the (clipped) gradients the optimizer is about to use are taken
    before every optimizer step, kept on the device, and the latest ones are
    written at each evaluation: ``{global_step, epoch, grad_norms: {name: norm}}``.
    """

    priority = 25
    LOG_FILENAME = "gradient_norms.json"

    def __init__(self) -> None:
        self._file = JsonArrayFile(self.LOG_FILENAME)
        self._names: list[str] = []
        self._norms: torch.Tensor | None = None
        self._step, self._epoch = -1, 0.0
        self._warned = [False]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._file.is_open:
            return
        params = _real_parameters(kwargs.get("model"), "GradNormLogger", self._warned)
        if params is None:
            return
        with_grad = [(n, p) for n, p in params if p.grad is not None]
        if not with_grad:
            return
        self._names = [n for n, _ in with_grad]
        with torch.no_grad():  # stays on the device: read back only when written
            self._norms = torch.stack([p.grad.detach().float().norm() for _, p in with_grad])
        self._step, self._epoch = state.global_step + 1, state.epoch  # the step being taken

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._file.is_open or self._norms is None:
            return
        norms = dict(zip(self._names, self._norms.tolist(), strict=True))
        self._file.write(self._step, self._epoch, {"grad_norms": norms})
        self._norms = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._file.close()


def _spectral(p: torch.Tensor, v: torch.Tensor | None, iters: int) -> tuple[float, Any]:
    """Largest singular value of ``p`` seen as a matrix (rows: its first dimension)."""
    if p.dim() < 2:
        return float(p.detach().float().norm()), None
    sigma, v = spectral_norm(p.detach().reshape(p.shape[0], -1), v, iters)
    return float(sigma), v


@answers_transformers_events
class ParameterNormLogger(_NormsFile):
    """Per-parameter L2 and spectral norms in ``<logging_dir>/parameter_norms.json``.

    ``ParameterNormLogger(log_norms=True, log_spectral_norms=True,
    power_iter_steps=10)``: one record per evaluation, ``{global_step, epoch,
    norms, spectral_norms}``. Spectral norms come from power iteration,
    warm-started from the previous evaluation; the first uses twice the steps.
    """

    LOG_FILENAME = "parameter_norms.json"
    priority = 25

    def __init__(
        self,
        log_norms: bool = True,
        log_spectral_norms: bool = True,
        power_iter_steps: int = 10,
    ) -> None:
        self.log_norms = _flag("log_norms", log_norms)
        self.log_spectral_norms = _flag("log_spectral_norms", log_spectral_norms)
        self.power_iter_steps = _positive_int("power_iter_steps", power_iter_steps)
        self._file = JsonArrayFile(self.LOG_FILENAME)
        self._vectors: dict[str, torch.Tensor] = {}
        self._first_eval = True
        self._warned = [False]

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._file.is_open:
            return
        params = _real_parameters(kwargs.get("model"), "ParameterNormLogger", self._warned)
        if params is None:
            return
        iters = self.power_iter_steps * (2 if self._first_eval else 1)
        self._first_eval = False
        record: dict[str, Any] = {}
        with torch.no_grad():
            if self.log_norms:
                values = torch.stack([p.detach().float().norm() for _, p in params]).tolist()
                record["norms"] = dict(zip([n for n, _ in params], values, strict=True))
            if self.log_spectral_norms:
                spectral = {}
                for name, p in params:
                    spectral[name], v = _spectral(p, self._vectors.get(name), iters)
                    if v is not None:
                        self._vectors[name] = v
                record["spectral_norms"] = spectral
        self._file.write(state.global_step, state.epoch, record)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._file.close()


# -- memory ------------------------------------------------------------------------------


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 1024**3:.3f} GiB" if num_bytes else "0 GiB"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


@answers_transformers_events
class PeakMemory(TrainerCallback):
    """Peak CUDA memory per rank: TensorBoard scalars, a log line, an optional snapshot.

    ``PeakMemory(summary_writer=None, show_details=False, do_log=False,
    enable_memory_snapshot=False, file_prefix="memory_snapshot")``. Rank and
    world size come from ``RANK`` / ``WORLD_SIZE`` (default 0 / 1). It is off
    unless the model is on a CUDA device. At each log it writes
    ``peak_memory_rank{i}`` (bytes) when given a writer and prints the peaks
    with ``do_log``; at train end it prints this rank's maximum. With
    ``enable_memory_snapshot`` it records allocation history and, at the first
    log, dumps ``{file_prefix}_rank{rank}.pickle`` in the working directory.
    """

    priority = 30

    def __init__(
        self,
        summary_writer: Any = None,
        show_details: bool = False,
        do_log: bool = False,
        enable_memory_snapshot: bool = False,
        file_prefix: str = "memory_snapshot",
    ) -> None:
        self.summary_writer = _check_writer("summary_writer", summary_writer, optional=True)
        self.show_details = _flag("show_details", show_details)
        self.do_log = _flag("do_log", do_log)
        self.enable_memory_snapshot = _flag("enable_memory_snapshot", enable_memory_snapshot)
        if not isinstance(file_prefix, str) or not file_prefix:
            raise ValueError(
                f"file_prefix must be a non-empty file name prefix, got {file_prefix!r}"
            )
        self.file_prefix = file_prefix
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.enabled = torch.cuda.is_available()
        self.max_allocated = 0
        self.snapshot_path: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        param = next(model.parameters(), None) if model is not None else None
        if param is None or param.device.type != "cuda":
            self.enabled = False
        if not self.enabled:
            return
        self.device = param.device
        self.max_allocated = 0
        if self.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled="all")

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled or (not self.do_log and self.summary_writer is None):
            return
        logs = kwargs.get("logs") or {}
        if self.enable_memory_snapshot:
            self.snapshot_path = f"{self.file_prefix}_rank{self.rank}.pickle"
            try:
                torch.cuda.memory._dump_snapshot(self.snapshot_path)
            except Exception as err:
                log.error("could not write the memory snapshot %s: %s", self.snapshot_path, err)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.enable_memory_snapshot = False
        peaks = logs.get("peak_mem_allocated")
        if not peaks:  # no per-rank list from the trainer: this rank's own figure
            peaks = [0] * self.world_size
            peaks[self.rank] = torch.cuda.max_memory_allocated(self.device)
        self.max_allocated = max(self.max_allocated, peaks[self.rank])
        if self.rank != 0:
            return
        if self.summary_writer is not None:
            for i, mem in enumerate(peaks):
                self.summary_writer.add_scalar(
                    f"peak_memory_rank{i}", mem, global_step=state.global_step
                )
            if self.show_details:
                self.summary_writer.add_text(
                    "peak_memory_details",
                    _markdown(torch.cuda.memory_stats(self.device)),
                    global_step=state.global_step,
                )
            self.summary_writer.flush()
        if self.do_log:
            ranks = ", ".join(f"RANK{i} {_gib(mem)}" for i, mem in enumerate(peaks))
            _say(f"Peak CUDA Memory Allocated: {ranks}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        self.max_allocated = max(self.max_allocated, torch.cuda.max_memory_allocated(self.device))
        if self.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
        _say(f"RANK{self.rank} MAX CUDA MEMORY ALLOCATED: {_gib(self.max_allocated)}")
        if self.show_details and not self.do_log and self.summary_writer is not None:
            self.summary_writer.add_text(
                "peak_memory_details",
                _markdown(torch.cuda.memory_stats(self.device)),
                global_step=state.global_step,
            )


def _forgather_prompts(prompts: Any) -> Any:
    """``prompts`` checked as Forgather checks them, with its messages: a list of strings,
    or the path of a YAML file holding one."""
    if isinstance(prompts, os.PathLike):
        prompts = str(prompts)
    if isinstance(prompts, str) and Path(prompts).is_file():
        import yaml

        loaded = yaml.safe_load(Path(prompts).read_text(encoding="utf-8"))
        if not isinstance(loaded, list):
            raise ValueError(
                f"From file {prompts}, expected 'prompts' to be a list but found {type(loaded)}"
            )
        prompts_list = loaded
    elif isinstance(prompts, list):
        prompts_list = prompts
    elif isinstance(prompts, str):
        return prompts  # not a file: the native loader says so
    else:
        raise ValueError(f"'prompts' must be List[str] | str, found {type(prompts)}")
    for prompt in prompts_list:
        if not isinstance(prompt, str):
            raise ValueError(f"Expected all prompts to be strings, but found {type(prompt)}")
    return prompts_list


def _say(text: str) -> None:
    """Forgather logs these lines at INFO; hookloop prints them so they are always seen."""
    log.info(text)
    print(text, file=sys.stderr, flush=True)


# -- text samples ------------------------------------------------------------------------

#: Forgather's sampling settings when no generation_config is given.
DEFAULT_GENERATION = {
    "do_sample": True,
    "top_k": 20,
    "temperature": 0.7,
    "repetition_penalty": 1.15,
}


@answers_transformers_events
class TextgenCallback(TrainerCallback):
    """Continuations of ``prompts`` in TensorBoard (tag ``eval-text``) at evaluations.

    ``TextgenCallback(summary_writer, prompts, generation_config=None,
    generation_steps=None, max_new_tokens=200)``: ``prompts`` is a list or the
    path of a YAML list; ``generation_config`` holds ``GenerationConfig``
    arguments; generation runs at the first evaluation at or past every
    ``generation_steps`` steps (default: ``args.eval_steps``). A model with
    ``generate`` (a transformers model) is sampled through it with the
    ``processing_class`` tokenizer; any other model through hookloop's own
    sampler (:class:`hookloop.callbacks.TextgenCallback`).
    """

    priority = 60

    def __init__(
        self,
        summary_writer: Any,
        prompts: list[str] | str,
        generation_config: dict[str, Any] | None = None,
        generation_steps: int | None = None,
        max_new_tokens: int = 200,
    ) -> None:
        from hookloop.callbacks.textgen import load_prompts

        self.summary_writer = _check_writer("summary_writer", summary_writer, optional=False)
        self.prompts = load_prompts(_forgather_prompts(prompts))
        if generation_config is not None and not isinstance(generation_config, Mapping):
            raise ValueError(
                f"generation_config must be a dict of GenerationConfig arguments or None, "
                f"got {generation_config!r}"
            )
        self.gen_config_args = dict(
            DEFAULT_GENERATION if generation_config is None else generation_config
        )
        self.generation_steps = _positive_int("generation_steps", generation_steps, optional=True)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        self.next_gen_step = 0
        self.last_text: str | None = None

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.generation_steps is None:
            self.generation_steps = getattr(args, "eval_steps", None) or state.eval_steps
        if not state.is_world_process_zero or state.global_step < self.next_gen_step:
            return
        self.next_gen_step += self.generation_steps
        model = kwargs.get("model")
        text = "".join(
            s + "\n\n---\n\n" for s in self.generate(model, kwargs.get("processing_class"))
        )
        self.last_text = text
        self.summary_writer.add_text("eval-text", text, global_step=state.global_step)
        self.summary_writer.flush()

    def generate(self, model: Any, tokenizer: Any) -> list[str]:
        """``prompt [START] continuation`` for each prompt."""
        if not callable(getattr(model, "generate", None)):
            return self._native(model)
        if tokenizer is None:
            raise ValueError(
                "TextgenCallback: the model has generate() but the trainer has no "
                "processing_class (tokenizer) to encode the prompts with"
            )
        from transformers import GenerationConfig

        # The tokenizer's special ids, the length cap and the sampling settings; sequences
        # come back in a dict so the prompt can be cut off the decoded text.
        special = {
            f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("eos", "bos", "pad")
        }
        settings = {**special, **self.gen_config_args, "max_new_tokens": self.max_new_tokens}
        config = GenerationConfig(return_dict_in_generate=True, **settings)
        # Left padding: every prompt ends where generation begins.
        encoded = tokenizer(
            list(self.prompts),
            return_tensors="pt",
            padding=True,
            padding_side="left",
            truncation=True,
        )
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                out = model.generate(
                    encoded["input_ids"].to(device),
                    attention_mask=encoded["attention_mask"].to(device),
                    generation_config=config,
                )
        finally:
            model.train(was_training)
        texts = tokenizer.batch_decode(out.sequences, skip_special_tokens=True)
        return [p + " [START] " + t[len(p) + 1 :] for p, t in zip(self.prompts, texts, strict=True)]

    def _native(self, model: Any) -> list[str]:
        from hookloop.callbacks.textgen import TextgenCallback as Native

        top_k = self.gen_config_args.get("top_k")
        sampler = Native(
            self.prompts,
            max_new_tokens=self.max_new_tokens,
            temperature=float(self.gen_config_args.get("temperature", 1.0))
            if self.gen_config_args.get("do_sample", True)
            else 0.0,
            top_k=top_k if isinstance(top_k, int) and top_k > 0 else None,
            print_samples=False,
        )
        return [
            p + " [START] " + t for p, t in zip(self.prompts, sampler.generate(model), strict=True)
        ]
