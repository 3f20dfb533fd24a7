"""A JSON Lines record of every log and evaluation event.

One line per event, flushed as written, so the file stays parseable even if
the process is killed (at most the line being written is lost). The logger is
stateful: a checkpoint remembers how far the file had been written, and a
resume cuts off whatever was written after it, so every event appears once.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

from hookloop.callback import Callback
from hookloop.state import CallbackContext


class JsonLogger(Callback):
    """Appends ``{"kind", "time", "step", "epoch", **metrics}`` records to ``path``."""

    priority = 100

    def __init__(self, path: str | Path) -> None:
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError(f"path must be a file path, got {path!r}")
        self.path = Path(path)
        self._file: TextIO | None = None

    def _write(self, kind: str, ctx: CallbackContext, values: dict[str, Any]) -> None:
        if not ctx.state.is_rank_zero:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        record = {
            "kind": kind,
            "time": round(time.time(), 3),
            "step": ctx.state.step,
            "epoch": ctx.state.epoch,
        }
        record.update({k: _jsonable(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def on_log(self, ctx: CallbackContext) -> None:
        self._write("train", ctx, ctx.logs or {})

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._write("eval", ctx, ctx.metrics or {})

    def on_test_end(self, ctx: CallbackContext) -> None:
        self._write("test", ctx, ctx.metrics or {})

    def on_train_end(self, ctx: CallbackContext) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        if self._file is not None:
            self._file.flush()
        return {"offset": self.path.stat().st_size if self.path.exists() else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Drop records written after the checkpoint (they will be written again)."""
        self.close()
        offset = int(state.get("offset", 0))
        if self.path.exists() and self.path.stat().st_size > offset:
            with self.path.open("r+b") as f:
                f.truncate(offset)

    def on_exception(self, ctx: CallbackContext) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read records back, ignoring a torn last line from a killed writer."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
