"""A JSON Lines record of every log and evaluation event, and of each run's start and end.

One line per event. The events, the resume and the flushes are those of every
logger (:class:`hookloop.callbacks.logger.Logger`); this module is the JSON
backend. The loop only hands each record to the shared background writer
(:mod:`hookloop.callbacks._writer`), which encodes and appends it and passes it
to the OS as soon as its queue is empty. The queue is drained before a
checkpoint's state is taken and again at ``on_checkpoint_save`` (then
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
``set``
    a live setting changed (:mod:`hookloop.loop.live`), one record per key, at the
    step whose end applied it: ``key``, ``old``, ``new`` and ``client`` (who sent it).
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

import math
from pathlib import Path
from typing import Any

from hookloop.callbacks.logger import Logger, Record, plain_values, run_status
from hookloop.journal import Journal
from hookloop.rundir import read_jsonl

__all__ = [
    "JsonLogger",
    "metric_tag",
    "numeric_metrics",
    "plain_values",
    "read_jsonl",
    "run_status",
]


class JsonLogger(Logger):
    """Appends ``{"kind", "time", "step", "epoch", **values}`` records to ``path``.

    The backend part of :class:`~hookloop.callbacks.logger.Logger`: one JSON line per
    record; a checkpoint keeps the file's size, and a resume truncates the file to it.
    """

    def __init__(self, path: str | Path) -> None:
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError(f"path must be a file path, got {path!r}")
        super().__init__()
        self.path = Path(path)
        self._journal = Journal(self.path)  # touched on the writer thread, or after a flush

    def write(self, record: Record) -> None:
        """On the writer thread: encode and append one record."""
        line = {
            "kind": record.kind,
            "time": round(record.time, 3),
            "step": record.step,
            "epoch": record.epoch,
        }
        line.update(record.values)
        for key, value in line.items():
            if type(value) is float and not math.isfinite(value):
                line[key] = str(value)  # JSON has no NaN/Inf; keep them visible as strings
        self._journal.append(line)
        if self.burst_over():  # let readers (tail, dashboards) see it
            self._journal.sync()

    def sync(self, durable: bool) -> None:
        self._journal.sync(durable)

    def position(self) -> dict[str, Any]:
        return {"offset": self._journal.offset()}

    def cut(self, step: int, saved: dict[str, Any] | None) -> None:
        """Truncate the file to the checkpoint's offset; without one, keep the records up
        to ``step``."""
        self.release()
        if saved is None:
            self._drop_records_after(step)
            return
        self._journal.cut(int(saved.get("offset", 0)))

    def _drop_records_after(self, step: int) -> None:
        """Rewind by content when no byte offset was restored: keep records up to ``step``."""
        if not self.path.is_file():
            return
        self._journal.rewrite([r for r in read_jsonl(self.path) if _step_of(r) <= step])

    def release(self) -> None:
        self._journal.close()


def _step_of(record: dict[str, Any]) -> int:
    step = record.get("step")
    return step if isinstance(step, int) else 0


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
