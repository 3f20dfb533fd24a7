"""``<run>/metrics.csv``: the logged numbers as one table, as Lightning's ``CSVLogger`` writes it.

One file, one row per record: a row per log event (``train``), and an evaluation's
metrics (``eval_loss``, ...; ``test_...`` after a test) on rows of their own at the step
they were taken, as Lightning puts validation metrics on their own rows. There is no
``kind`` column: a row's filled cells say what it is, and a spreadsheet or
``pandas.read_csv`` reads the file as it would read Lightning's.

Columns: ``step``, ``epoch``, then every other key in the order it was first seen. A key
that first appears later (an evaluation's, a producer callback's) widens the table: the
file is rewritten with the wider header, every row kept, into a file beside it that then
replaces it (:func:`os.replace`), so a reader or a kill never sees half a table. A cell a
row has no value for is empty. Keys and values go through the :mod:`csv` module, so a
comma, a quote or a newline in either is quoted, not a broken row.

The events, the resume and the flushes are those of every logger
(:class:`~hookloop.callbacks.logger.Logger`); a resume or a rewind drops the rows past
the restored step (by content: a widening may have rewritten the file since the
checkpoint, so a byte offset would not do), rewriting the file the same atomic way.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import IO, Any

from hookloop.callbacks.logger import Logger, Record

__all__ = ["CSVLogger", "read_csv_rows"]

#: Record kinds that make a row; the others (start, end, set, rewind) live in metrics.jsonl.
ROW_KINDS = ("train", "eval", "test")
#: The first columns, always.
LEADING = ("step", "epoch")


class CSVLogger(Logger):
    """Appends a row per log event and per evaluation to ``path`` (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError(f"path must be a file path, got {path!r}")
        super().__init__()
        self.path = Path(path)
        self._columns: list[str] | None = None  # the header, once read or written
        self._handle: IO[str] | None = None

    # -- the backend ------------------------------------------------------------------
    def write(self, record: Record) -> None:
        """On the writer thread: one row; a new key first widens the file."""
        if record.kind not in ROW_KINDS:
            return
        row = _row_of(record)
        columns = self._header()
        new = [key for key in row if key not in columns]
        if new:
            self._rewrite(columns + new, self._read_rows())
        handle = self._open()
        csv.DictWriter(handle, self._header(), lineterminator="\n").writerow(row)
        if self.burst_over():
            handle.flush()

    def cut(self, step: int, saved: dict[str, Any] | None) -> None:
        """Keep the rows up to ``step`` (``saved`` is not needed: rows carry their step)."""
        self.release()
        if not self.path.is_file():
            return
        rows = self._read_rows()
        kept = [r for r in rows if _step_of(r) <= step]
        if len(kept) < len(rows):
            self._rewrite(self._header(), kept)

    def position(self) -> dict[str, Any]:
        return {"columns": list(self._header())}

    def sync(self, durable: bool) -> None:
        if self._handle is not None:
            self._handle.flush()
            if durable:
                os.fsync(self._handle.fileno())

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()

    # -- the file ---------------------------------------------------------------------
    def _header(self) -> list[str]:
        """The columns: the file's header when it has one, else the leading two."""
        if self._columns is None:
            self._columns = list(LEADING)
            if self.path.is_file():
                with self.path.open(newline="", encoding="utf-8") as file:
                    first = next(csv.reader(file), None)
                if first:
                    self._columns = first
        return self._columns

    def _open(self) -> IO[str]:
        if self._handle is None:
            fresh = not self.path.is_file() or self.path.stat().st_size == 0
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.path.open("a", newline="", encoding="utf-8")
            if fresh:
                csv.writer(self._handle, lineterminator="\n").writerow(self._header())
        return self._handle

    def _read_rows(self) -> list[dict[str, str]]:
        self.release()
        return read_csv_rows(self.path) if self.path.is_file() else []

    def _rewrite(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        """Replace the file by ``columns`` and ``rows`` in one step: a reader sees the old
        table or the new one, never a part."""
        self.release()
        text = io.StringIO()
        writer = csv.DictWriter(text, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_name(self.path.name + ".tmp")
        with staged.open("w", newline="", encoding="utf-8") as file:
            file.write(text.getvalue())
            file.flush()
            os.fsync(file.fileno())
        os.replace(staged, self.path)
        self._columns = list(columns)


def read_csv_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a ``metrics.csv`` as dicts of strings (an empty cell: ``""``)."""
    with Path(path).open(newline="", encoding="utf-8") as file:
        return [dict(row) for row in csv.DictReader(file)]


def _row_of(record: Record) -> dict[str, Any]:
    """``step`` and ``epoch`` first (the record's step wins over a value of that name),
    then the values; None is an empty cell."""
    row: dict[str, Any] = {"step": record.step, "epoch": record.epoch}
    for key, value in record.values.items():
        if key != "step":
            row[str(key)] = "" if value is None else value
    return row


def _step_of(row: dict[str, str]) -> int:
    try:
        return int(row.get("step") or 0)
    except ValueError:
        return 0
