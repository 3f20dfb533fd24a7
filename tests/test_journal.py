"""hookloop.journal: the one append-only JSON Lines writer and reader behind metrics.jsonl,
changes.jsonl (runs and the DiLoCo server) and norms.jsonl."""

from __future__ import annotations

import json
import os

import pytest

from hookloop.callbacks import JsonLogger
from hookloop.errors import ConfigError
from hookloop.journal import Journal, cut_torn_tail, read_records

TORN = b'{"step": 1}\n{"step": 2}\n{"step": 3, "lo'


def test_an_append_after_a_kill_tore_the_last_line_starts_on_its_own_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # What a plain append does: the next record glues itself to the fragment; both are lost.
    path.write_bytes(TORN)
    with path.open("a") as f:
        f.write(json.dumps({"step": 4}) + "\n")
    assert [r["step"] for r in read_records(path)] == [1, 2]
    # The journal cuts the fragment (never a record) first.
    path.write_bytes(TORN)
    journal = Journal(path)
    journal.append({"step": 4})
    journal.close()
    assert [r["step"] for r in read_records(path)] == [1, 2, 4]
    assert path.read_bytes().endswith(b'{"step": 4}\n')


def test_the_torn_tail_is_found_past_a_long_last_line_and_in_a_file_with_no_newline(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"a": 1}\n' + b"x" * 200_000)  # longer than one backward read
    with path.open("a+b") as f:
        assert cut_torn_tail(f) == 200_000
    assert path.read_bytes() == b'{"a": 1}\n'
    path.write_bytes(b"no newline at all")
    with path.open("a+b") as f:
        assert cut_torn_tail(f) == len(b"no newline at all")
    assert path.read_bytes() == b""
    with path.open("a+b") as f:  # nothing to cut
        assert cut_torn_tail(f) == 0


def test_fsync_mode_puts_each_record_on_disk_before_append_returns(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    journal = Journal(tmp_path / "changes.jsonl", fsync=True)
    journal.append({"id": "a"})
    assert len(synced) == 1 and read_records(tmp_path / "changes.jsonl") == [{"id": "a"}]
    buffered = Journal(tmp_path / "metrics.jsonl")
    buffered.append({"step": 1})
    assert len(synced) == 1  # a batch waits for sync()
    buffered.sync(durable=True)
    assert len(synced) == 2
    journal.close(), buffered.close()


def test_a_checkpointed_offset_cuts_later_records_and_rewrite_is_whole(tmp_path):
    journal = Journal(tmp_path / "m.jsonl")
    journal.append({"step": 1})
    saved = journal.offset()
    journal.append({"step": 2})
    journal.cut(saved)
    journal.append({"step": 3})
    journal.sync()  # a buffered journal's readers see what was synced
    assert [r["step"] for r in read_records(journal.path)] == [1, 3]
    journal.rewrite([{"step": 9}])
    assert read_records(journal.path) == [{"step": 9}]
    assert not journal.path.with_name("m.jsonl.tmp").exists()


def test_a_record_that_would_span_lines_is_refused(tmp_path):
    journal = Journal(tmp_path / "j.jsonl", encode=lambda r: json.dumps(r, indent=1))
    with pytest.raises(ValueError, match="one line"):
        journal.append({"a": 1})
    assert not (tmp_path / "j.jsonl").exists() or (tmp_path / "j.jsonl").read_bytes() == b""


def test_the_reader_skips_a_torn_last_line_and_strict_names_any_other_bad_line(tmp_path):
    path = tmp_path / "changes.jsonl"
    path.write_text('{"id": "a"}\n[1, 2]\n{"id": "c"}\n{"id": "d", "st', encoding="utf-8")
    assert [r["id"] for r in read_records(path)] == ["a", "c"]
    with pytest.raises(ConfigError, match=r"changes.jsonl:2 is not a change record$"):
        read_records(path, strict=True, what="a change record")
    path.write_text('{"id": "a"}\n{"id": 7}\n{"id": "c"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=":2 is not"):
        read_records(path, strict=True, check=lambda r: isinstance(r["id"], str))
    assert read_records(tmp_path / "missing.jsonl") == []


def test_a_run_started_on_a_torn_metrics_file_keeps_every_whole_record(tmp_path, make_trainer):
    """A user's view: a run killed mid-line, then a new run writing to the same file,
    loses only the torn line: the new run's records all read back."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"kind": "train", "step": 1, "loss": 1.0}\n{"kind": "tra')
    make_trainer([JsonLogger(metrics)], max_steps=3, log_every=1).train()
    kinds = [r["kind"] for r in read_records(metrics)]
    assert kinds[0] == "train" and kinds[1] == "start" and kinds[-1] == "end"
    assert all(line.startswith("{") for line in metrics.read_text().splitlines())


def test_a_chained_journal_links_each_record_to_the_one_before_across_reopens(tmp_path):
    from hookloop.journal import ChainError, chain_start, check_chain

    path = tmp_path / "outer.jsonl"
    for value in (1, 2):  # a journal per append, as a process that restarts would
        journal = Journal(path, fsync=True, chain="outer")
        written = journal.append({"value": value})
        journal.close()
    records = read_records(path)
    assert records[0]["prev"] == chain_start("outer") and written == records[1]
    assert records[1]["prev"] == records[0]["hash"]
    assert check_chain(path, records, "outer") == 0
    with pytest.raises(ChainError, match=r"outer\.jsonl:1: it does not follow"):
        check_chain(path, records, "another journal")  # the seed is part of the chain
    forged = [*records, {"value": 3}]
    with pytest.raises(ChainError, match=r"outer\.jsonl:3: it carries no chain hash"):
        check_chain(path, forged, "outer")
    assert check_chain(path, forged, "outer", skip=lambda r: r["value"] == 3) == 0
