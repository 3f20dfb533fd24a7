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

A journal may be **chained** (``chain=SEED``): each record then carries ``prev``, the
``hash`` of the record before it (the first one's is :func:`chain_start` of ``SEED``),
and its own ``hash``, a SHA-256 of its canonical bytes (:func:`canonical`: sorted keys,
no spaces, without ``hash``). A record added, edited, reordered or copied by hand breaks
the chain where it stands; :func:`check_chain` names it. A file written before chaining
(no record has ``prev``) reads as before.

A full disk (or quota) during an append is one :class:`JournalWriteError` naming the file
and saying the records before it are intact; the partial line is cut at once.

:func:`read_records` is the reader: a torn last line (no newline after it) is skipped;
any other line that is not a JSON object is skipped too, or, with ``strict``, refused in
one line naming it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from hookloop.errors import ConfigError

__all__ = [
    "ChainError",
    "Journal",
    "JournalWriteError",
    "canonical",
    "chain_start",
    "check_chain",
    "cut_torn_tail",
    "read_records",
]

#: How far back from the end :func:`cut_torn_tail` reads at a time.
_CHUNK = 64 * 1024
#: The errors of a disk that cannot take more: full, or over the user's quota.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class JournalWriteError(OSError):
    """An append the disk could not take; the message names the file and what is intact."""


class ChainError(ConfigError):
    """A chained journal's record that does not follow the one before it.

    ``line`` (1-based), ``record`` (the JSON object) and ``problem`` (what is wrong, a few
    words) let the caller say how to proceed in its own terms."""

    def __init__(self, path: Path, line: int, record: dict[str, Any], problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}")
        self.path, self.line, self.record, self.problem = path, line, record, problem


def canonical(record: Mapping[str, Any]) -> bytes:
    """The bytes a chained record's ``hash`` covers: the record without ``hash``, keys
    sorted, no spaces (so re-encoding it, from the file or a checkpoint, gives them again)."""
    body = {k: v for k, v in record.items() if k != "hash"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


def record_hash(record: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of :func:`canonical` ``(record)``."""
    return hashlib.sha256(canonical(record)).hexdigest()


def chain_start(seed: str) -> str:
    """The ``prev`` of a chained journal's first record: a hash of the journal's ``seed``."""
    return hashlib.sha256(f"hookloop journal {seed}".encode()).hexdigest()


class Journal:
    """An append-only JSON Lines file at ``path``, opened on the first append.

    ``fsync``: every append is on disk before it returns. ``encode``: how a record
    becomes one line (``json.dumps`` by default; it must not contain a newline).
    ``chain``: the seed of a chained journal (see the module doc); each append then adds
    ``prev`` and ``hash`` to the record it writes, and returns it.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        fsync: bool = False,
        encode: Callable[[Mapping[str, Any]], str] = json.dumps,
        chain: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.encode = encode
        self.chain = chain
        self._file: IO[bytes] | None = None
        self._head: str | None = None  # the hash the next chained record follows

    def append(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``record`` as one line (and fsync it when the journal says so); returns
        the record as written (with ``prev`` and ``hash`` in a chained journal).

        A full disk raises :class:`JournalWriteError` and leaves the file as it was."""
        handle = self._open()
        written = dict(record)
        if self.chain is not None:
            written = {k: v for k, v in written.items() if k not in ("prev", "hash")}
            written["prev"] = self._head
            written["hash"] = record_hash(written)
        line = self.encode(written)
        if "\n" in line:
            raise ValueError(f"a {self.path.name} record must encode to one line")
        start = handle.seek(0, os.SEEK_END)
        try:
            handle.write(line.encode("utf-8") + b"\n")
            if self.fsync:
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as err:
            self._undo(start)
            if err.errno not in DISK_FULL:
                raise
            raise self._disk_full(err, "this record was not written") from err
        if self.chain is not None:
            self._head = written["hash"]
        return written

    def _undo(self, start: int) -> None:
        """After a failed write: drop what is buffered and cut the file back to ``start``."""
        handle, self._file = self._file, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()  # may flush part of the buffer again: cut below
        with contextlib.suppress(OSError):  # if it fails, the next append cuts a torn line
            os.truncate(self.path, start)

    def _disk_full(self, err: OSError, lost: str) -> JournalWriteError:
        return JournalWriteError(
            err.errno,
            f"{self.path}: the disk is full ({os.strerror(err.errno or 0)}); {lost}, the "
            f"{self.path.name} records before it are intact",
            str(self.path),
        )

    def sync(self, durable: bool = False) -> None:
        """Hand what was appended to the OS (readers see it); ``durable``: to the disk."""
        if self._file is None:
            return
        try:
            self._file.flush()
            if durable:
                os.fsync(self._file.fileno())
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            raise self._disk_full(err, "the records of this batch may be cut short") from err

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
            if self.chain is not None:
                self._head = _last_hash(handle) or chain_start(self.chain)
            self._file = handle
        return self._file


def _last_hash(handle: IO[bytes]) -> str | None:
    """The ``hash`` of the last record of an open journal (None: empty, or unchained)."""
    end = handle.seek(0, os.SEEK_END)
    start = max(0, end - _CHUNK)
    handle.seek(start)
    tail = handle.read(end - start).rstrip(b"\n")
    handle.seek(0, os.SEEK_END)
    last = tail.rsplit(b"\n", 1)[-1]
    try:
        record = json.loads(last)
    except ValueError:
        return None
    found = record.get("hash") if isinstance(record, dict) else None
    return found if isinstance(found, str) else None


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

    A torn last line (from a kill: no newline after it) is skipped. Any other line that is
    not a JSON object (or fails ``check``) is skipped, or with ``strict`` refused with a
    :class:`~hookloop.errors.ConfigError` naming the file, the line and ``what`` a line
    must be."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.splitlines()
    torn = len(lines) if lines and not text.endswith("\n") else 0
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and (check is None or check(record)):
            records.append(record)
        elif strict and number != torn:
            raise ConfigError(f"{path}:{number} is not {what}")
    return records


def check_chain(
    path: str | Path,
    records: list[dict[str, Any]],
    seed: str,
    skip: Callable[[dict[str, Any]], bool] = lambda record: False,
) -> int:
    """Check that ``records`` (every line of a chained journal, in order) form its chain;
    returns how many come before the chain began (written before journals were chained).

    Raises :class:`ChainError` for the first record that was added, edited, reordered or
    duplicated by hand. A record ``skip`` accepts is not checked: the chain goes on from
    the hash it claims, or, if it has none, from the record before it."""
    legacy = next((i for i, r in enumerate(records) if "prev" in r), len(records))
    heads, seen = {chain_start(seed)}, set[str]()  # the first chained record follows the start
    for index, record in enumerate(records[legacy:], legacy + 1):
        claimed = record.get("hash")
        if skip(record):
            heads = heads | {claimed} if isinstance(claimed, str) else heads
            continue
        problem = _link_problem(record, heads, seen)
        if problem is not None:
            raise ChainError(Path(path), index, record, problem)
        assert isinstance(claimed, str)  # a record without its hash has a problem above
        heads = {claimed}
        seen.add(claimed)
    return legacy


def _link_problem(record: dict[str, Any], heads: set[str], seen: set[str]) -> str | None:
    """What is wrong with one chained record, or None."""
    if not isinstance(record.get("hash"), str) or "prev" not in record:
        return "it carries no chain hash: it was not written by hookloop (added by hand)"
    if record["hash"] != record_hash(record):
        return "its contents do not match its hash: it was edited after it was written"
    if record["hash"] in seen:
        return "it repeats an earlier record (a duplicated line)"
    if record["prev"] not in heads:
        return (
            "it does not follow the record before it: a record was removed, reordered "
            "or copied in from elsewhere"
        )
    return None
