"""Progress output: a tqdm bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from hookloop.callback import Callback
from hookloop.state import CallbackContext


def format_metrics(values: dict[str, Any], keys: list[str] | None = None) -> str:
    """``loss 2.31 | lr 3.0e-04`` for the chosen keys (all numeric ones by default)."""
    parts = []
    for key in keys or list(values):
        value = values.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, int):
            parts.append(f"{key} {value}")
        elif value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            parts.append(f"{key} {value:.3e}")
        else:
            parts.append(f"{key} {value:.4f}")
    return " | ".join(parts)


class ProgressBar(Callback):
    """Shows training progress on rank 0.

    On a terminal: a tqdm bar over optimizer steps, with the latest logged
    metrics as its postfix and evaluation results written above it. Elsewhere
    (a file, CI, a pipe): one plain line per log event, with steps per second.
    """

    priority = 110

    def __init__(
        self,
        columns: list[str] | None = None,
        *,
        stream: TextIO | None = None,
        use_tqdm: bool | None = None,
    ) -> None:
        if columns is not None and not all(isinstance(c, str) for c in columns):
            raise ValueError(f"columns must be a list of metric names, got {columns!r}")
        self.columns = columns or ["loss", "lr", "grad_norm"]
        self.stream = stream
        self.use_tqdm = use_tqdm
        self._bar: Any = None
        self._last_step = 0
        self._last_time = 0.0

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def on_train_start(self, ctx: CallbackContext) -> None:
        if not ctx.state.is_rank_zero:
            return
        tty = self._out().isatty() if self.use_tqdm is None else self.use_tqdm
        self._last_step, self._last_time = ctx.state.step, time.monotonic()
        if tty:
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

    def on_log(self, ctx: CallbackContext) -> None:
        if not ctx.state.is_rank_zero or ctx.logs is None:
            return
        text = format_metrics(ctx.logs, self.columns)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            return
        now = time.monotonic()
        rate = (ctx.state.step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = ctx.state.step, now
        total = f"/{ctx.state.max_steps}" if ctx.state.max_steps else ""
        print(
            f"step {ctx.state.step}{total} | {text} | {rate:.2f} steps/s",
            file=self._out(),
            flush=True,
        )

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if ctx.state.is_rank_zero and ctx.metrics:
            self._write(f"eval @ step {ctx.state.step} | {format_metrics(ctx.metrics)}")

    def on_test_end(self, ctx: CallbackContext) -> None:
        if ctx.state.is_rank_zero and ctx.metrics:
            self._write(f"test | {format_metrics(ctx.metrics)}")

    def on_train_end(self, ctx: CallbackContext) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if ctx.state.is_rank_zero:
            self._write(f"training ended at step {ctx.state.step}: {ctx.state.stop_reason}")

    def on_exception(self, ctx: CallbackContext) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._out())
        else:
            print(text, file=self._out(), flush=True)
