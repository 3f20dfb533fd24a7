"""Progress output: tqdm bars on a terminal, a plain table of log lines elsewhere.

On a terminal there is a bar over optimizer steps, with the latest logged
metrics as its postfix, and, while an evaluation or test runs, a second bar over
its batches; evaluation results are written above the bars. Anywhere else (a
file, CI, a pipe) each log event prints one row of a table whose header is
printed again every ``header_every`` rows and whenever the set of columns shown
changes, so a long log stays readable at any point. ``min_interval`` limits
this by wall time: a log event less than that many seconds after the last shown
one is not shown (the next row's steps/s covers both), which keeps printing off
the step time of a fast loop; ``hookloop train`` uses ``logging.progress_interval``.

Which metrics appear, under what label and in what format, is a list of
:class:`Column` (only columns whose key is in the log event are shown).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TextIO

from hookloop.callback import Callback
from hookloop.result import reason_without_step
from hookloop.state import CallbackContext


def format_metrics(values: dict[str, Any], keys: list[str] | None = None) -> str:
    """``loss 2.31 | lr 3.0e-04`` for the chosen keys (all numeric ones by default)."""
    parts = []
    for key in keys or list(values):
        value = values.get(key)
        if is_number(value):
            parts.append(f"{key} {_auto(value)}")
    return " | ".join(parts)


def is_number(value: Any) -> bool:
    """A plain int or float (not a bool): what the display formats as a number."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _auto(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4f}"


@dataclass(frozen=True)
class Column:
    """One displayed metric: its key in the logs, a label, a format spec and a width.

    ``fmt`` is a format spec (``".4f"``, ``".1%"``, ``",.0f"``); ``None`` picks one
    by magnitude. ``width`` is the minimum cell width in plain mode (default:
    the label's width, at least 10).
    """

    key: str
    label: str | None = None
    fmt: str | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"Column.key must be a metric name, got {self.key!r}")
        if self.width is not None and (not isinstance(self.width, int) or self.width < 1):
            raise ValueError(f"Column.width must be an int >= 1 or None, got {self.width!r}")
        if self.fmt is not None:
            try:
                format(1.5, self.fmt)
            except (TypeError, ValueError):
                raise ValueError(
                    f"Column.fmt must be a format spec for a number (e.g. '.4f'), got {self.fmt!r}"
                ) from None

    @property
    def title(self) -> str:
        return self.label if self.label is not None else self.key

    @property
    def cell_width(self) -> int:
        return max(len(self.title), self.width or 10)

    def format(self, value: float) -> str:
        return format(value, self.fmt) if self.fmt is not None else _auto(value)


#: Shown by default, in this order, when present in a log event.
DEFAULT_COLUMNS: tuple[Column, ...] = (
    Column("loss", "loss", ".4f"),
    Column("lr", "lr", ".2e"),
    Column("grad_norm", "grad_norm", ".3f"),
    Column("tok_per_sec", "tok/s", ",.0f"),
    Column("samples_per_sec", "samples/s", ",.1f"),
    Column("mfu", "mfu", ".1%", width=7),
    Column("peak_mem_mib", "mem MiB", ",.0f"),
)
_DEFAULTS = {c.key: c for c in DEFAULT_COLUMNS}


def resolve_columns(columns: Any) -> list[Column]:
    """Turn the ``columns`` argument into a list of :class:`Column`.

    ``None``: the defaults. A list of names or ``Column``: exactly those (a known
    name keeps its default label and format). A mapping ``{key: None | Column |
    {"label", "fmt", "width"}}``: the defaults with those changed, added, or (for
    ``None``) removed.
    """
    if columns is None:
        return list(DEFAULT_COLUMNS)
    if isinstance(columns, Mapping):
        merged: dict[str, Column | None] = dict(_DEFAULTS)
        for key, spec in columns.items():
            if not isinstance(key, str):
                raise ValueError(f"columns keys must be metric names, got {key!r}")
            if spec is None:
                merged[key] = None
            elif isinstance(spec, Column):
                merged[key] = replace(spec, key=key)
            elif isinstance(spec, Mapping):
                unknown = set(spec) - {"label", "fmt", "width"}
                if unknown:
                    raise ValueError(
                        f"columns[{key!r}] has unknown fields {sorted(unknown)}; "
                        "allowed: label, fmt, width"
                    )
                base = merged.get(key) or Column(key)
                merged[key] = replace(base, **spec)
            else:
                raise ValueError(
                    f"columns[{key!r}] must be None, a Column or a dict of label/fmt/width, "
                    f"got {spec!r}"
                )
        return [c for c in merged.values() if c is not None]
    if isinstance(columns, Iterable) and not isinstance(columns, (str, bytes)):
        out = []
        for item in columns:
            if isinstance(item, Column):
                out.append(item)
            elif isinstance(item, str) and item:
                out.append(_DEFAULTS.get(item, Column(item)))
            else:
                raise ValueError(f"columns must hold metric names or Column objects, got {item!r}")
        return out
    raise ValueError(
        "columns must be None, a list of metric names / Column objects, or a mapping "
        f"of overrides, got {columns!r}"
    )


class ProgressBar(Callback):
    """Shows training progress on rank 0 (see the module doc).

    ``use_tqdm`` ``None`` picks bars when ``stream`` is a terminal. ``stream`` is a
    text stream or ``"stdout"`` / ``"stderr"`` (default stderr). ``header_every``
    re-prints the plain-mode header after that many rows. ``min_interval``
    (seconds, default 0: every log event) is the least wall time between two
    shown log events, in rows or in the bar's metrics. Forgather's names
    ``output_stream``, ``step_columns`` and ``header_interval`` are accepted too.
    """

    priority = 110

    def __init__(
        self,
        columns: Any = None,
        *,
        stream: TextIO | str | None = None,
        use_tqdm: bool | None = None,
        header_every: int = 20,
        output_stream: TextIO | str | None = None,
        step_columns: Any = None,
        header_interval: int | None = None,
        min_interval: float = 0.0,
    ) -> None:
        stream = _alias("stream", stream, None, "output_stream", output_stream)
        columns = _alias("columns", columns, None, "step_columns", step_columns)
        if header_interval is not None:
            if header_every != 20:
                raise ValueError("give header_every or Forgather's header_interval, not both")
            header_every = header_interval
        if isinstance(header_every, bool) or not isinstance(header_every, int) or header_every < 1:
            raise ValueError(f"header_every must be an int >= 1, got {header_every!r}")
        if (
            isinstance(min_interval, bool)
            or not isinstance(min_interval, (int, float))
            or not 0 <= min_interval < float("inf")
        ):
            raise ValueError(
                "min_interval must be a number of seconds >= 0 (0: every log event), "
                f"got {min_interval!r}"
            )
        if use_tqdm is not None and not isinstance(use_tqdm, bool):
            raise ValueError(f"use_tqdm must be True, False or None (auto), got {use_tqdm!r}")
        if isinstance(stream, str) and stream not in ("stdout", "stderr"):
            raise ValueError(f"stream must be a text stream, 'stdout' or 'stderr', got {stream!r}")
        self.columns = resolve_columns(columns)
        self.stream = stream
        self.use_tqdm = use_tqdm
        self.header_every = header_every
        self.min_interval = float(min_interval)
        self._bar: Any = None
        self._eval_bar: Any = None
        self._eval_total: dict[str, int] = {}  # batches seen in the last run of each kind
        self._rows = 0
        self._shown: tuple[str, ...] = ()
        self._last_step = 0
        self._last_time = 0.0
        self._next_show = 0.0  # monotonic time before which a log event is not shown

    def _out(self) -> TextIO:
        if self.stream == "stdout":
            return sys.stdout
        if self.stream is None or self.stream == "stderr":
            return sys.stderr
        return self.stream  # type: ignore[return-value]  # any other value is a stream

    def _tty(self) -> bool:
        if self.use_tqdm is not None:
            return self.use_tqdm
        isatty = getattr(self._out(), "isatty", None)
        return bool(isatty and isatty())

    # -- training ----------------------------------------------------------
    def on_train_start(self, ctx: CallbackContext) -> None:
        if not ctx.state.is_rank_zero:
            return
        self._last_step, self._last_time = ctx.state.step, time.monotonic()
        self._next_show = 0.0
        self._rows, self._shown = 0, ()
        if self._tty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=ctx.state.max_steps,
                initial=ctx.state.step,
                unit="step",
                dynamic_ncols=True,
                file=self._out(),
            )

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        """A rewind (:mod:`hookloop.checkpoint.rewind`) moves the step back: the bar follows."""
        if ctx.rewind is None or not ctx.state.is_rank_zero:
            return
        self._last_step, self._last_time = ctx.state.step, time.monotonic()
        if self._bar is not None:
            self._bar.n = self._bar.last_print_n = ctx.state.step
            self._bar.refresh()

    def on_log(self, ctx: CallbackContext) -> None:
        if not ctx.state.is_rank_zero or ctx.logs is None:
            return
        now = time.monotonic()
        if now < self._next_show:
            return
        self._next_show = now + self.min_interval
        shown = [c for c in self.columns if is_number(ctx.logs.get(c.key))]
        if self._bar is not None:
            if self._bar.total != ctx.state.max_steps:
                self._bar.total = ctx.state.max_steps
            text = " | ".join(f"{c.title} {c.format(ctx.logs[c.key])}" for c in shown)
            self._bar.set_postfix_str(text, refresh=False)
            return
        rate = (ctx.state.step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = ctx.state.step, now
        keys = tuple(c.key for c in shown)
        step_width = self._step_width(ctx)
        if self._rows % self.header_every == 0 or keys != self._shown:
            self._print(self.header(shown, step_width))
            self._shown = keys
        self._rows += 1
        cells = [f"{self._step_text(ctx):>{step_width}}"]
        cells += [f"{c.format(ctx.logs[c.key]):>{c.cell_width}}" for c in shown]
        cells.append(f"{rate:>8.2f}")
        self._print("  ".join(cells))

    @staticmethod
    def header(shown: list[Column], step_width: int = 6) -> str:
        """The plain-mode header line for these columns."""
        cells = [f"{'step':>{step_width}}"]
        cells += [f"{c.title:>{c.cell_width}}" for c in shown]
        cells.append(f"{'steps/s':>8}")
        return "  ".join(cells)

    @staticmethod
    def _step_text(ctx: CallbackContext) -> str:
        total = ctx.state.max_steps
        return f"{ctx.state.step}/{total}" if total else str(ctx.state.step)

    @staticmethod
    def _step_width(ctx: CallbackContext) -> int:
        total = ctx.state.max_steps
        return max(6, 2 * len(str(total)) + 1) if total else 8

    # -- evaluation and testing ----------------------------------------------
    def on_eval_start(self, ctx: CallbackContext) -> None:
        self._open_eval_bar(ctx, "eval")

    def on_eval_step_end(self, ctx: CallbackContext) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._close_eval_bar("eval")
        if ctx.state.is_rank_zero and ctx.metrics:
            self.write(f"eval @ step {ctx.state.step} | {format_metrics(ctx.metrics)}")

    def on_test_start(self, ctx: CallbackContext) -> None:
        self._open_eval_bar(ctx, "test")

    def on_test_step_end(self, ctx: CallbackContext) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)

    def on_test_end(self, ctx: CallbackContext) -> None:
        self._close_eval_bar("test")
        if ctx.state.is_rank_zero and ctx.metrics:
            self.write(f"test | {format_metrics(ctx.metrics)}")

    def _open_eval_bar(self, ctx: CallbackContext, kind: str) -> None:
        if not ctx.state.is_rank_zero or not self._tty():
            return
        from tqdm.auto import tqdm

        self._close_eval_bar(None)
        self._eval_bar = tqdm(
            total=self._eval_total.get(kind) or _batches(ctx, kind),
            desc=kind,
            unit="batch",
            leave=False,
            dynamic_ncols=True,
            file=self._out(),
        )

    def _close_eval_bar(self, kind: str | None) -> None:
        if self._eval_bar is None:
            return
        if kind is not None:
            self._eval_total[kind] = self._eval_bar.n
        self._eval_bar.close()
        self._eval_bar = None

    # -- the end -------------------------------------------------------------
    def on_train_end(self, ctx: CallbackContext) -> None:
        self._close_bars()
        if ctx.state.is_rank_zero:
            step, reason = ctx.state.step, ctx.state.stop_reason or "finished"
            self.write(f"training ended at step {step}: {reason_without_step(reason, step)}")

    def on_exception(self, ctx: CallbackContext) -> None:
        self._close_bars()

    def _close_bars(self) -> None:
        self._close_eval_bar(None)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def write(self, text: str) -> None:
        """A line of text on the display's stream, above the bar while one is drawn."""
        if self._bar is not None:
            self._bar.write(text, file=self._out())
        else:
            self._print(text)

    def _print(self, text: str) -> None:
        print(text, file=self._out(), flush=True)


def _batches(ctx: CallbackContext, kind: str) -> int | None:
    """How many batches the coming evaluation or test will run, when that is known."""
    return ctx.run.eval_batches if kind == "eval" else ctx.run.test_batches


def _alias(name: str, value: Any, default: Any, alias: str, alias_value: Any) -> Any:
    """``value``, or Forgather's ``alias_value`` for it when that one was given."""
    if alias_value is None:
        return value
    if value is not default:
        raise ValueError(f"give {name} or Forgather's {alias}, not both")
    return alias_value
