"""Pausing a DiLoCo server's outer loop (``POST /control/pause`` and ``/control/resume``).

While the outer loop is paused no round advances: a submission (full model or fragment,
sync or async) is answered **503** with a JSON body that says so (``"paused": true``,
:class:`OuterLoopPaused`), and the workers waiting at an open barrier when the pause
came get the same answer at once, their contributions dropped. The global weights and
the outer optimizer stay as they are.

Why 503: it is the answer Forgather's own worker already lives through. Its client turns
any HTTP error of a sync into a ``ConnectionError``; the worker then waits (2 s, 4 s,
...), registers again (which loads the global weights over its local ones) and, after
``max_sync_retries`` failures, skips the round and trains on. hookloop's worker reads
``"paused": true`` (:class:`hookloop.diloco.client.ServerPaused`) and does better: no
retry, no registering again, its local weights and its copy of the global weights kept,
so its next pseudo-gradient covers every local step since the weights it last got. A
paused answer reached the server, so it never counts as a missed sync.

The pause and the resume are recorded before they take effect, a line each in
``<output_dir>/changes.jsonl`` (``{"event": "pause", "sync_round", "client", "time"}``),
where the outer optimizer's changes go (:mod:`hookloop.diloco.admin`). A server started
again on that output dir reads the last of them and **stays paused** if the last was a
pause: an operator paused for a reason, and a crash or a restart should not merge rounds
behind their back.

The journal is hash-chained (:mod:`hookloop.journal`, as a run's ``changes.jsonl``): a
record added, edited, reordered or duplicated by hand stops the server at start with one
line naming it, so a hand-written "resume" cannot unpause it; records written before the
journal was chained are read with one warning.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hookloop.diloco.roster import ProtocolError
from hookloop.errors import ConfigError
from hookloop.journal import ChainError, Journal, check_chain, read_records

log = logging.getLogger("hookloop.diloco")

#: The journal the server records its operators' changes in (under ``output_dir``).
CHANGES = "changes.jsonl"
#: The status of the answer to a submission while paused (Service Unavailable).
PAUSED_STATUS = 503
#: What the journal's first record's ``prev`` is made from (:func:`hookloop.journal.chain_start`).
CHAIN_SEED = "diloco changes.jsonl"


def record_change(output_dir: str | Path, record: dict[str, Any]) -> None:
    """Append ``record`` to ``output_dir``'s journal, chained and fsynced."""
    journal = Journal(Path(output_dir) / CHANGES, fsync=True, chain=CHAIN_SEED)
    try:
        journal.append(record)
    finally:
        journal.close()


def read_changes(output_dir: str | Path) -> list[dict[str, Any]]:
    """The journal's records, its chain checked (a torn last line, from a kill, skipped).
    A record not written by the server is a :class:`ConfigError` in one line."""
    path = Path(output_dir) / CHANGES
    records = read_records(path, strict=True, what="a DiLoCo change record (a JSON object)")
    try:
        legacy = check_chain(path, records, CHAIN_SEED)
    except ChainError as err:
        raise ConfigError(
            f"{err}; the DiLoCo server will not start on a journal changed by hand: put back "
            f"the file it wrote, or move {path.name} aside to start without its history"
        ) from None
    if legacy:
        log.warning("diloco: %s: %d record(s) written before the journal was chained; read "
                    "unchecked", path, legacy)  # fmt: skip
    return records


def clock(when: float) -> str:
    """A Unix time as the local ``YYYY-MM-DD HH:MM:SS`` an operator reads."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def who(client: Any) -> str:
    """The name a request gives itself (``client``), or ``unknown``: printable, 80 chars."""
    if isinstance(client, str) and client and client.isprintable():
        return client[:80]
    return "unknown"


class OuterLoopPaused(ProtocolError):
    """A submission the paused server does not take (503, ``"paused": true``)."""

    def __init__(self, since: float, by: str, sync_round: int) -> None:
        super().__init__(
            f"the DiLoCo server's outer loop is paused (since {clock(since)}, by {by}) at "
            f"round {sync_round}: train on locally and sync again at the next sync point",
            PAUSED_STATUS,
        )
        self.since, self.by, self.sync_round = since, by, sync_round

    def reply(self) -> dict[str, Any]:
        return {**super().reply(), "paused": True, "paused_since": self.since,
                "paused_by": self.by, "sync_round": self.sync_round}  # fmt: skip


class OuterPause:
    """Whether the outer loop is paused, since when and by whom, kept in ``output_dir``'s
    journal; built from the journal's last pause or resume (see the module text)."""

    since: float | None  # a Unix time, while paused
    by: str | None  # who paused, while paused

    def __init__(self, output_dir: str) -> None:
        self.path = Path(output_dir) / CHANGES
        self.paused, self.since, self.by = False, None, None
        last = [r for r in read_changes(output_dir) if r.get("event") in ("pause", "resume")]
        if last and last[-1]["event"] == "pause":
            record = last[-1]
            when = record.get("time")
            self.paused = True
            self.since = float(when) if isinstance(when, (int, float)) else time.time()
            self.by = who(record.get("client"))

    def refusal(self, sync_round: int) -> OuterLoopPaused:
        """The answer to a submission while paused."""
        assert self.since is not None and self.by is not None
        return OuterLoopPaused(self.since, self.by, sync_round)

    def check(self, sync_round: int) -> None:
        """Raise :class:`OuterLoopPaused` while the outer loop is paused."""
        if self.paused:
            raise self.refusal(sync_round)

    def pause(self, client: Any, sync_round: int) -> dict[str, Any]:
        """Pause (recorded first); 409 naming since when and by whom if already paused."""
        if self.paused:
            raise ProtocolError(
                f"pause: the outer loop is already paused (since {clock(self.since or 0)}, "
                f"by {self.by}); nothing changed", 409
            )  # fmt: skip
        by, now = who(client), time.time()
        self._record("pause", by, sync_round, now)
        self.paused, self.since, self.by = True, now, by
        log.warning("diloco: outer loop paused at round %d by %s; workers train on locally",
                    sync_round, by)  # fmt: skip
        return {"status": "ok", **self.state(), "sync_round": sync_round}

    def resume(self, client: Any, sync_round: int) -> dict[str, Any]:
        """Resume (recorded first); 409 if the outer loop is not paused."""
        if not self.paused:
            raise ProtocolError("resume: the outer loop is not paused; nothing changed", 409)
        by, now = who(client), time.time()
        self._record("resume", by, sync_round, now)
        held = now - (self.since or now)
        self.paused, self.since, self.by = False, None, None
        log.warning("diloco: outer loop resumed at round %d by %s after %.0f s paused",
                    sync_round, by, held)  # fmt: skip
        return {"status": "ok", **self.state(), "sync_round": sync_round,
                "paused_seconds": round(held, 3)}  # fmt: skip

    def state(self) -> dict[str, Any]:
        """``paused``, ``paused_since`` (Unix time) and ``paused_by``, for ``/status``."""
        return {"paused": self.paused, "paused_since": self.since, "paused_by": self.by}

    def _record(self, event: str, by: str, sync_round: int, now: float) -> None:
        record = {"event": event, "sync_round": sync_round, "client": by, "time": now}
        record_change(self.path.parent, record)
