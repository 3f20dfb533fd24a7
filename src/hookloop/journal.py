"""Append-only JSON Lines files: the one way hookloop writes and reads its journals.

A run keeps several files that only ever grow, one JSON object per line:
``metrics.jsonl`` (every log and evaluation), ``changes.jsonl`` (live settings, and the
DiLoCo server's outer-optimizer changes), ``norms.jsonl``. They share three rules, kept
here once:

* **A line is written whole or not at all.** A process killed mid-write leaves at most
  its last line torn. Before the first append the torn tail is cut off (it was never a
  record), so the next record starts on a line of its own instead of gluing itself to
  the fragment, which would lose both.
* **Durability is the writer's choice, per append or per batch.** ``fsync=True`` makes
  each :meth:`Journal.append` reach the disk before it returns (a change must be on disk
  before it is made); otherwise :meth:`Journal.sync` flushes a batch (a checkpoint
  forces one, durable).
* **A checkpoint remembers the length**, and a resume :meth:`Journal.cut` s the file back
  to it, so no record is written twice after a restart.

:func:`read_records` is the reader: a torn last line is skipped; any other line that is
not a JSON object is skipped too, or, with ``strict``, refused in one line naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from hookloop.errors import ConfigError

__all__ = ["Journal", "cut_torn_tail", "read_records"]

#: How far back from the end :func:`cut_torn_tail` reads at a time.
_CHUNK = 64 * 1024


class Journal:
    """An append-only JSON Lines file at ``path``, opened on the first append.

    ``fsync``: every append is on disk before it returns. ``encode``: how a record
    becomes one line (``json.dumps`` by default; it must not contain a newline).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        fsync: bool = False,
        encode: Callable[[Mapping[str, Any]], str] = json.dumps,
    ) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.encode = encode
        self._file: IO[bytes] | None = None

    def append(self, record: Mapping[str, Any]) -> None:
        """Write ``record`` as one line (and fsync it when the journal says so)."""
        line = self.encode(record)
        if "\n" in line:
            raise ValueError(f"a {self.path.name} record must encode to one line")
        handle = self._open()
        handle.write(line.encode("utf-8") + b"\n")
        if self.fsync:
            handle.flush()
            os.fsync(handle.fileno())

    def sync(self, durable: bool = False) -> None:
        """Hand what was appended to the OS (readers see it); ``durable``: to the disk."""
        if self._file is not None:
            self._file.flush()
            if durable:
                os.fsync(self._file.fileno())

    def offset(self) -> int:
        """The file's length once flushed: what a checkpoint keeps to :meth:`cut` back to."""
        self.sync()
        return self.path.stat().st_size if self.path.exists() else 0

    def cut(self, offset: int) -> None:
        """Truncate the file to ``offset`` bytes (a checkpoint's :meth:`offset`)."""
        self.close()
        if self.path.exists() and self.path.stat().st_size > offset:
            with self.path.open("r+b") as handle:
                handle.truncate(offset)

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the whole file with ``records`` (atomically: a new file renamed over it)."""
        self.close()
        staged = self.path.with_name(self.path.name + ".tmp")
        staged.write_text("".join(self.encode(r) + "\n" for r in records), encoding="utf-8")
        os.replace(staged, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> IO[bytes]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+b")  # noqa: SIM115 (kept open; closed by close())
            cut_torn_tail(handle)
            self._file = handle
        return self._file


def cut_torn_tail(handle: IO[bytes]) -> int:
    """Truncate an open (``a+b``) file after its last newline; return the bytes cut.

    Reads back from the end only as far as the last newline, so a long journal costs
    one small read."""
    end = handle.seek(0, os.SEEK_END)
    position = end
    while position > 0:
        start = max(0, position - _CHUNK)
        handle.seek(start)
        chunk = handle.read(position - start)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        position = start
    else:
        keep = 0
    if keep < end:
        handle.truncate(keep)
    handle.seek(0, os.SEEK_END)
    return end - keep


def read_records(
    path: str | Path,
    *,
    strict: bool = False,
    check: Callable[[dict[str, Any]], bool] | None = None,
    what: str = "a JSON object",
) -> list[dict[str, Any]]:
    """The records of a journal, in order; ``[]`` when there is no file.

    A torn last line (from a kill) is skipped. Any other line that is not a JSON object
    (or fails ``check``) is skipped, or with ``strict`` refused with a
    :class:`~hookloop.errors.ConfigError` naming the file, the line and ``what`` a line
    must be."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and (check is None or check(record)):
            records.append(record)
        elif strict and number < len(lines):
            raise ConfigError(f"{path}:{number} is not {what}")
    return records
