"""A run's ``changes.jsonl``: every live ``set`` applied to it, chained, and read back checked.

Each record is one JSON line ``{"id", "step", "values", "changes", "client", "time",
"prev", "hash"}`` written through :class:`~hookloop.journal.Journal` with a chain
(:data:`CHAIN_SEED`): ``hash`` covers the record, ``prev`` is the record before it's.
A resume (and ``--replay``) replays the records, so one added, edited, reordered or
duplicated by hand would steer the run without a word; :func:`read_replayable` refuses
such a record by name, in one line that says how to go on (``--skip-change ID``, or
moving the file aside). A file written before records were chained is read with one
warning.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from hookloop.errors import ConfigError
from hookloop.journal import ChainError, Journal, check_chain, read_records

#: What the first record's ``prev`` is made from (:func:`hookloop.journal.chain_start`).
CHAIN_SEED = "changes.jsonl"
#: What a line of ``changes.jsonl`` must be.
CHANGE_RECORD = "a change record (a JSON object with id, step, values)"


def append_change(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Append ``record`` to ``path``, chained and fsynced; returns it as written."""
    journal = Journal(path, fsync=True, encode=_strict_json, chain=CHAIN_SEED)
    try:
        return journal.append(record)
    finally:
        journal.close()


def read_changes(path: Path) -> list[dict[str, Any]]:
    """The records of a ``changes.jsonl`` in order (a torn last line, from a kill, skipped;
    any other malformed line is an error naming it). Not checked against the chain."""
    return read_records(path, strict=True, check=_is_change, what=CHANGE_RECORD)


def read_replayable(
    path: Path, skip: Collection[str] = (), *, warn: bool = True
) -> list[dict[str, Any]]:
    """The records of ``path`` a resume or a replay may apply: every line a change record,
    the chain whole, none repeating an id; ``skip`` (``--skip-change`` ids) left out.

    Anything else is a :class:`~hookloop.errors.ConfigError` in one line naming the record,
    what is wrong with it and how to go on."""
    try:
        records = read_changes(path)
    except ConfigError as err:
        raise ConfigError(f"{err}; {_how_to_go_on(path, None)}") from None
    unknown = sorted(set(skip) - {r["id"] for r in records})
    if unknown:
        raise ConfigError(f"--skip-change {unknown[0]}: {path} has no record with that id")
    try:
        legacy = check_chain(path, records, CHAIN_SEED, skip=lambda r: r["id"] in skip)
    except ChainError as err:
        what, ident = describe(err.record), err.record["id"]
        if err.problem.startswith("it repeats"):  # --skip-change would drop the original too
            how = f"to go on, delete line {err.line} of {path.name} (a copy)"
        else:
            how = _how_to_go_on(path, ident)
        raise ConfigError(f"{err.path}:{err.line}: change {what}: {err.problem}; {how}") from None
    if legacy and warn:
        print(
            f"hookloop: warning: {path}: {legacy} record(s) written before change records "
            "were chained; they are replayed unchecked",
            file=sys.stderr,
        )
    seen: set[str] = set()
    for record in records:
        if record["id"] in seen and record["id"] not in skip:
            raise ConfigError(
                f"{path}: change {describe(record)} repeats the id of an earlier record; "
                f"{_how_to_go_on(path, record['id'])}"
            )
        seen.add(record["id"])
    return [r for r in records if r["id"] not in skip]


def describe(record: dict[str, Any]) -> str:
    """A record in a few words: ``ID (step N: lr=0.02, clip_grad_norm=0.5)``."""
    values = record.get("values")
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items()) if isinstance(values, dict) else ""
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{record.get('id')} (step {record.get('step')}: {shown})"


def _how_to_go_on(path: Path, ident: Any) -> str:
    skip = f"leave it out with --skip-change {ident}, or " if isinstance(ident, str) else ""
    return f"to go on, {skip}move {path.name} aside (its changes are then not replayed)"


def _is_change(record: dict[str, Any]) -> bool:
    return (
        isinstance(record.get("step"), int)
        and isinstance(record.get("values"), dict)
        and isinstance(record.get("id"), str)
    )


def _strict_json(record: Any) -> str:
    return json.dumps(record, allow_nan=False)
