"""A JSON Lines record of every log and evaluation event, and of each run's start and end.

One line per event. The loop only hands each record to the shared background
writer (:mod:`hookloop.callbacks._writer`), which encodes and appends it and
passes it to the OS as soon as its queue is empty. The queue is drained before
a checkpoint's state is taken and again at ``on_checkpoint_save`` (then
fsynced), at the end of training, after an exception and at exit; so a killed
process leaves every record up to its last checkpoint, and at most the line
being written is torn (:func:`read_jsonl` skips it). Every record has ``kind``,
``time`` (Unix seconds, when the event happened), ``step`` and ``epoch``; the
other keys depend on the kind:

``start``
    training began (``train()``): ``pid``, ``host``, ``resumed`` (bool) and
    ``max_steps``. A resumed run writes a new ``start`` record.
``train``
    a log event: every value in ``ctx.logs`` (loss, lr, grad_norm, ... and
    whatever producer callbacks added).
``eval`` / ``test``
    an evaluation: every value in ``ctx.metrics`` (``eval_loss``, ...).
``rewind``
    a divergence rolled back (:mod:`hookloop.checkpoint.rewind`), written at the restored
    step after the records past it were cut off as on a resume: ``count``,
    ``from_step``, ``to_step``, ``since_step``, ``batches_skipped``,
    ``checkpoint``, ``reason``, ``lr_factor``, ``lr_steps``.
``end``
    training ended: ``status`` (see :func:`run_status`) and ``stop_reason``;
    after an exception also ``error``. A killed process leaves no ``end``
    record after its last ``start``: that is how ``hookloop runs`` tells a
    killed run from a finished one.

The logger is stateful: a checkpoint remembers how far the file had been
written, and a resume cuts off whatever was written after it, so every step
appears once. A resume that finds no checkpoint for this logger (for example a
run killed before its first checkpoint, restarted with ``--resume auto``)
keeps only the records up to the step it restarts from.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, TextIO

from hookloop.callback import Callback
from hookloop.callbacks._writer import log_writer
from hookloop.state import CallbackContext


def run_status(stop_reason: str | None) -> str:
    """``finished`` (the step or epoch budget was reached), ``aborted``, or ``stopped``.

    ``stopped`` covers every other orderly end: a stop request, a signal,
    ``exit_interval`` or ``exit_duration`` (these save a checkpoint and can be resumed).
    """
    reason = stop_reason or ""
    if reason in ("max_steps", "max_epochs", "finished", ""):
        return "finished"
    if reason.startswith("abort"):
        return "aborted"
    return "stopped"


class JsonLogger(Callback):
    """Appends ``{"kind", "time", "step", "epoch", **values}`` records to ``path``."""

    priority = 100

    def __init__(self, path: str | Path) -> None:
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError(f"path must be a file path, got {path!r}")
        self.path = Path(path)
        self._file: TextIO | None = None  # touched on the writer thread, or after a flush
        self._writer = log_writer()
        self._restored = False  # set by load_state_dict, read once at the next train start

    def _write(self, kind: str, ctx: CallbackContext, values: dict[str, Any]) -> None:
        if not ctx.state.is_rank_zero:
            return
        st = ctx.state
        record = {"kind": kind, "time": round(time.time(), 3), "step": st.step, "epoch": st.epoch}
        if plain_values(values):  # usual: numbers, read back already
            record.update(values)  # converted (NaN/Inf to strings) on the writer thread
        else:  # a tensor is read here, while it holds this step's number
            for key, value in values.items():
                record[key] = value if type(value) in _PLAIN else _jsonable(value)
        self._writer.submit(self._append, record)

    def _append(self, record: dict[str, Any]) -> None:
        """On the writer thread: encode and append one record."""
        for key, value in record.items():
            if type(value) is float and not math.isfinite(value):
                record[key] = str(value)  # JSON has no NaN/Inf; keep them visible as strings
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")
        if self._writer.idle():  # a burst is over: let readers (tail, dashboards) see it
            self._file.flush()

    def flush(self) -> None:
        """Wait until every record handed over so far has reached the OS."""
        self._writer.flush()
        if self._file is not None:
            self._file.flush()

    def _sync(self) -> None:
        """On the writer thread: put the records on disk (the loop does not wait for it)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def on_train_start(self, ctx: CallbackContext) -> None:
        restored, self._restored = self._restored, False
        if ctx.run.resuming and not restored and ctx.state.is_rank_zero:
            self._drop_records_after(ctx.state.step)
        self._write(
            "start",
            ctx,
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "resumed": ctx.state.step > 0,
                "max_steps": ctx.state.max_steps,
            },
        )

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        if ctx.rewind is not None:  # a rewind: the file was cut back by load_state_dict
            self._write("rewind", ctx, ctx.rewind.to_json())

    def on_log(self, ctx: CallbackContext) -> None:
        self._write("train", ctx, ctx.logs or {})

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._write("eval", ctx, ctx.metrics or {})

    def on_test_end(self, ctx: CallbackContext) -> None:
        self._write("test", ctx, ctx.metrics or {})

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        if ctx.state.is_rank_zero:
            self.flush()  # a SIGKILL from now on leaves every record up to this checkpoint
            self._writer.submit(self._sync)

    def on_train_end(self, ctx: CallbackContext) -> None:
        reason = ctx.state.stop_reason
        status = "failed" if ctx.state.failed else run_status(reason)
        self._write("end", ctx, {"status": status, "stop_reason": reason})
        self.close()

    def on_exception(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training:  # a start that failed: no start record, so no end
            self.close()
            return
        exc = ctx.exception
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        error = f"{type(exc).__name__}: {exc}"[:500] if exc is not None else None
        self._write("end", ctx, {"status": status, "stop_reason": status, "error": error})
        self.close()

    def state_dict(self) -> dict[str, Any]:
        self.flush()  # the offset counts every record written before this checkpoint
        return {"offset": self.path.stat().st_size if self.path.exists() else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Drop records written after the checkpoint (they will be written again)."""
        self.close()
        self._restored = True
        offset = int(state.get("offset", 0))
        if self.path.exists() and self.path.stat().st_size > offset:
            with self.path.open("r+b") as f:
                f.truncate(offset)

    def _drop_records_after(self, step: int) -> None:
        """Rewind by content when no byte offset was restored: keep records up to ``step``."""
        self.close()
        if not self.path.is_file():
            return
        kept = [r for r in read_jsonl(self.path) if _step_of(r) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def close(self) -> None:
        self._writer.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def _step_of(record: dict[str, Any]) -> int:
    step = record.get("step")
    return step if isinstance(step, int) else 0


_PLAIN = (int, str, bool, type(None))  # written as they are (floats may be NaN/Inf)
_SCALARS = {int, float, str, bool, type(None)}


def plain_values(values: dict[str, Any]) -> bool:
    """Whether every value is a plain Python scalar: nothing to read from a device, so a
    logger may hand the values to its writer thread as they are."""
    return set(map(type, values.values())) <= _SCALARS


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
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def numeric_metrics(values: dict[str, Any] | None) -> dict[str, float]:
    """The values a plot or a scalar dashboard can show: numbers, as floats.

    Booleans and strings are left out; 0-dim tensors and NumPy scalars are
    converted; the strings ``"nan"``/``"inf"`` that the JSON log uses for
    non-finite numbers come back as floats.
    """
    out: dict[str, float] = {}
    for key, value in (values or {}).items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, str):
            if value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
                out[key] = float(value)
        elif getattr(value, "ndim", None) == 0 or getattr(value, "shape", None) == ():
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                continue
    return out


def metric_tag(kind: str, key: str) -> str:
    """Dashboard name for a logged value: ``train/loss``, ``eval/loss``, ``test/accuracy``.

    Train log keys get a ``train/`` prefix; evaluation keys lose their
    ``eval_`` (or ``test_``) prefix and get ``eval/`` (``test/``) instead, so
    TensorBoard and W&B group each kind in its own section.
    """
    if kind in ("eval", "test"):
        bare = key[len(kind) + 1 :] if key.startswith(kind + "_") else key
        return f"{kind}/{bare}"
    return f"{kind}/{key}"
