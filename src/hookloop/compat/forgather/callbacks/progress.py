"""Forgather's ``ProgressCallback``: progress, a metric table and the end-of-training summary.

The native :class:`hookloop.callbacks.ProgressBar` draws the table; this module adds
Forgather's constructors (its current one, its older ``show_*`` form and transformers'
``max_str_len`` form) and the one-line summary printed when training ends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from hookloop.callbacks import progress as _progress
from hookloop.compat.forgather.callbacks.common import check_flag, check_positive_int, log
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.state import CallbackContext

__all__ = [
    "DEFAULT_FINAL_METRICS",
    "ProgressCallback",
    "format_final_metrics",
    "resolve_final_metrics",
]


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
            header_every=check_positive_int("header_interval", header_interval),
        )
        self.final_metrics = resolve_final_metrics(final_metrics)
        self.max_str_len = check_positive_int("max_str_len", max_str_len)
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
        self.write(format_final_metrics(logs, self.final_metrics))


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
    given = _older_positional(third, fourth, fifth, rest)
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
        check_flag(name, values[name])
    peak = values["peak_hardware_flops"]
    if peak is not None and (
        isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0
    ):
        raise ValueError(f"peak_hardware_flops must be a FLOP/s figure > 0 or None, got {peak!r}")
    return _older_columns(values), values["header_interval"]


def _older_positional(third: Any, fourth: Any, fifth: Any, rest: tuple[Any, ...]) -> dict[str, Any]:
    """The older form's flags given by position (the constructor's third argument on), or
    the newer form's ``header_interval`` when the flags come by name."""
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
    return given


def _older_columns(values: dict[str, Any]) -> dict[str, Any]:
    """The native step columns the older form's ``show_*`` flags (checked) choose."""
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
    if values["peak_hardware_flops"] is not None:
        log.warning(
            "ProgressCallback(peak_hardware_flops=...) is Forgather's older form: the mfu "
            "column shows what DefaultMetrics(peak_hardware_flops=%g) logs",
            values["peak_hardware_flops"],
        )
    return columns
