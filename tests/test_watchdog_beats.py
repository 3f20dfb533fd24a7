"""A value read from the watchdog's store is input (hookloop.watchdog_beats).

For each malformed value a rank could read under another's key, the test first shows
what the watchdog made of it before beats were checked (``json.loads`` and then the
Watch, the message, the ``progress.txt`` line and the status rows): an exception, which
ended the watchdog thread ("stopped watching") and so hang detection; a rank never
named; or another rank's text reaching a terminal as sent. Then the refusal (or the
cleaned beat). Last, rank 0's real watchdog thread against a real TCPStore on 127.0.0.1:
forged values are planted under rank 1's key between its beats, and it keeps watching and
names rank 2, which falls silent (tests/_watchdog_job.py ``forged``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from hookloop.watchdog import Watch, message, progress_line, rank_rows
from hookloop.watchdog_beats import (
    FIELDS,
    MAX_BEAT_BYTES,
    MAX_STACK,
    BeatReader,
    RefusedBeat,
    check_beat,
    encode_beat,
)

JOB = str(Path(__file__).with_name("_watchdog_job.py"))
ESC = "\x1b"


def beat(rank: int = 1, seq: int = 1, **fields) -> dict:
    """A running rank's beat, as the watchdog writes it."""
    return {
        "rank": rank, "host": "node7", "pid": 4000 + rank, "step": 3, "event": None,
        "callback": None, "collective": None, "frame": "backward (graph.py:10)",
        "time": 1.7e9, "seq": seq, "state": "running", "deadline": 4.0, "still_s": 0.0,
        "stuck_s": 0.0, "stack": None, **fields,
    }  # fmt: skip


def value(**fields) -> bytes:
    return json.dumps(beat(**fields)).encode()


#: json.dumps writes ``Infinity``, which is no JSON; ``1e999`` is, and json.loads makes it inf.
INFINITE_DEADLINE = value().replace(b'"deadline": 4.0', b'"deadline": 1e999')


def unchecked(raw: bytes) -> tuple[Watch, str, str]:
    """What rank 0 made of rank 1's value before beats were checked: ``json.loads`` it,
    feed the Watch, and, rank 1 silent for 60 s, the message and the progress.txt line
    ("" when nobody was named)."""
    watch = Watch(rank=0, world=2)
    watch.saw({0: beat(0, 1), 1: json.loads(raw)}, now=0.0)
    watch.saw({0: beat(0, 2)}, now=60.0)
    verdict = watch.verdict(now=60.0, deadline=4.0)
    if verdict is None:
        return watch, "", ""
    return watch, message(verdict, 2, None), progress_line(verdict, 2, 0.0)


def refusal(raw: bytes, rank: int = 1) -> str:
    with pytest.raises(RefusedBeat) as refused:
        check_beat(raw, rank)
    return str(refused.value)


# -- values that stopped the watchdog thread -------------------------------------------------

STOPPED_IT = [
    pytest.param(b"<html>502 Bad Gateway</html>", json.JSONDecodeError,
                 "it is not JSON (Expecting value: line 1 column 1 (char 0)); allowed: a JSON "
                 "object", id="not JSON"),
    pytest.param(b"\xc3\x28 not UTF-8", ValueError,
                 "it is not UTF-8 (byte 0); allowed: a JSON object", id="not UTF-8"),
    pytest.param(b"[1, 2, 3]", TypeError, "it is a JSON list; allowed: a JSON object",
                 id="not an object"),
    pytest.param(b'{"rank": 1, "seq": 2, "mood": "odd"}', KeyError,
                 "it lacks 'callback', 'collective', 'deadline', 'event', 'frame', 'host', 'pid', "
                 "'stack', 'state', 'step', 'still_s', 'stuck_s', 'time'; it has unknown fields "
                 "'mood'; allowed: exactly 'rank', 'host', 'pid', 'step', ", id="missing fields"),
    pytest.param(value(deadline="soon"), ValueError,
                 "field 'deadline' is 'soon'; allowed: a finite number of seconds from 0 to "
                 "1000000000",
                 id="wrong type"),
    pytest.param(b'{"step": 1' + b"0" * 5000 + b"}", ValueError,
                 "it is not JSON (Exceeds the limit (4300 digits) for integer string",
                 id="huge int"),
    pytest.param(b"[" * 50_000, RecursionError, "it is not JSON (maximum recursion depth",
                 id="deep nesting"),
    pytest.param(value(state="hung", stuck_s=5.0, stack=["frame"]), AttributeError,
                 "field 'stack' is ['frame']; allowed: null or a text of at most 49152 "
                 "characters", id="a stack that is no text"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "old_error", "why"), STOPPED_IT)
def test_a_value_that_stopped_the_watchdog_thread_is_refused_naming_what_is_allowed(
    raw, old_error, why
):
    with pytest.raises(old_error):  # raised in the watchdog thread, which then stopped
        unchecked(raw)
    assert refusal(raw).startswith(why)


def test_a_100_mb_value_is_refused_by_its_size_before_it_is_parsed():
    stack = "x" * 100_000_000
    raw = value(state="hung", stuck_s=9.0, stack=stack)
    _, said, _ = unchecked(raw)
    assert stack in said  # before: a 100 MB stack printed to every rank's stderr
    assert refusal(raw) == f"it is {len(raw)} bytes; at most 65536 are allowed"


# -- values that kept a rank from ever being named, or named the wrong way -------------------


@pytest.mark.parametrize(
    ("raw", "why"),
    [(INFINITE_DEADLINE, "field 'deadline' is inf; allowed: a finite number of seconds"),
     (value(deadline=1e300), "field 'deadline' is 1e+300; allowed: a finite number of seconds"),
     (value(rank=0, state="finished"), "it says rank 0; allowed: 1, its key's rank")],
    ids=["infinite deadline", "huge deadline", "another rank's beat"],
)  # fmt: skip
def test_a_value_that_kept_a_silent_rank_from_being_named_is_refused(raw, why):
    _, said, _ = unchecked(raw)
    assert said == ""  # before: rank 1, silent for 60 s with a 4 s deadline, never named
    assert refusal(raw).startswith(why)


def test_nan_named_a_rank_stuck_for_nan_seconds_and_is_refused():
    raw = value(state="hung", stuck_s=math.nan)
    _, said, line = unchecked(raw)
    assert "stuck for nan s" in said and "Why: stuck for nan s" in line
    assert refusal(raw) == "it is not JSON (NaN is no number); allowed: a JSON object"


@pytest.mark.parametrize(
    ("field", "bad", "allowed"),
    [("state", "zombie", "one of running, paused, hung, finished, failed"),
     ("step", -1, "a whole number from 0 to 9223372036854775807"),
     ("step", 2**64, "a whole number from 0 to 9223372036854775807"),
     ("pid", True, "a whole number from 0 to 2147483647"),
     ("seq", 1.5, "a whole number from 0 to 9223372036854775807"),
     ("still_s", -3.0, "a finite number of seconds from 0 to 1000000000"),
     ("host", "h" * 513, "null or a text of at most 512 characters")],
)  # fmt: skip
def test_a_field_outside_its_type_or_range_is_refused_though_it_was_taken(field, bad, allowed):
    watch, _, _ = unchecked(value(**{field: bad}))
    assert watch.beats[1][field] == bad  # before: taken as it came
    shown = repr(bad) if len(repr(bad)) <= 60 else repr(bad)[:57] + "..."
    assert refusal(value(**{field: bad})) == f"field {field!r} is {shown}; allowed: {allowed}"


# -- text that reached a terminal as another rank sent it ----------------------------------


def test_escape_sequences_and_line_breaks_in_another_ranks_texts_are_stripped():
    forged = {
        "host": "node\x1b]0;owned\x07\x1b[2J7", "callback": "Up\x1b[1A\r\nload", "event": "on_log",
        "frame": "f\nhookloop watchdog: all is well\t(x.py:1)", "state": "hung", "stuck_s": 9.0,
        "stack": '  File "cb.py", line 3, in upload\x1b[31m\n\tspin()\x9b2J\u202etxt.exe\n',
    }  # fmt: skip
    watch, said, line = unchecked(value(**forged))
    rows = rank_rows(watch, 60.0)
    assert ESC in said and ESC in line and ESC in rows[1]["host"]  # before: as sent
    assert line.count("\n") == 2  # a forged callback split the progress.txt line
    clean = check_beat(value(**forged), 1)
    assert (clean["host"], clean["callback"]) == ("node]0;owned[2J7", "Up[1Aload")
    assert clean["frame"] == "fhookloop watchdog: all is well(x.py:1)"
    assert clean["stack"] == '  File "cb.py", line 3, in upload[31m\n\tspin()2Jtxt.exe\n'
    watch = Watch(rank=0, world=2)
    watch.saw({0: beat(0, 1), 1: clean}, now=0.0)
    verdict = watch.verdict(now=0.0, deadline=4.0)
    text, line, rows = (
        message(verdict, 2, None),
        progress_line(verdict, 2, 0.0),
        rank_rows(watch, 0.0),
    )
    assert not any(ESC in str(x) for x in (text, line, rows))
    assert line.count("\n") == 1 and line.count("\t") == 10  # one line, its eleven fields


def test_a_lone_surrogate_could_not_be_printed_and_is_stripped():
    raw = value(host="node\ud8007")  # JSON writes it as \ud800
    watch, _, _ = unchecked(raw)
    with pytest.raises(UnicodeEncodeError):  # what print() to a UTF-8 stderr raised
        watch.beats[1]["host"].encode("utf-8")
    assert check_beat(raw, 1)["host"] == "node7"


# -- what the watchdog does with a refusal ---------------------------------------------------


def test_a_refusal_is_said_once_per_rank_and_reason_and_the_last_good_beat_stands():
    said: list[str] = []
    reader = BeatReader(said.append)
    good = value(seq=1)
    assert reader.read([b"null", good]) == {0: None, 1: check_beat(good, 1)}
    for tick in range(4):  # four ticks, two different values that are no JSON
        assert reader.read([b"null", b"<html>%d</html>" % (tick % 2)]) == {}
    assert reader.read([b"null", INFINITE_DEADLINE]) == {}
    assert said == [
        "hookloop watchdog: ignoring a beat of rank 1: it is not JSON (Expecting value: line 1 "
        "column 1 (char 0)); allowed: a JSON object. Its last good beat stands; without a "
        "good one for the deadline it is named as hung.",
        "hookloop watchdog: ignoring a beat of rank 1: field 'deadline' is inf; allowed: a "
        "finite number of seconds from 0 to 1000000000. Its last good beat stands; without a good "
        "one for the deadline it is named as hung.",
    ]
    assert reader.refused == {1: "its beats were refused: field 'deadline' is inf; allowed: "
                                 "a finite number of seconds from 0 to 1000000000"}  # fmt: skip
    assert reader.read([b"null", value(seq=2)])[1]["seq"] == 2 and reader.refused == {}


def test_a_rank_whose_beats_stay_refused_is_named_as_silent_with_the_reason():
    reader, watch = BeatReader(lambda line: None), Watch(rank=0, world=3)
    watch.saw(reader.read([value(rank=0), value(seq=1), b"null"]), 0.0, reader.refused)
    for tick in range(1, 11):  # rank 1 keeps writing, rank 2 only garbage, every 0.5 s
        values = [value(rank=0, seq=tick), b"{%d" % tick, b"[%d]" % tick]
        watch.saw(reader.read(values), tick / 2, reader.refused)
    verdict = watch.verdict(now=5.0, deadline=4.0)
    assert verdict is not None and verdict.rank == 1 and verdict.beat["seq"] == 1
    assert message(verdict, 3, None).splitlines()[0] == (
        "hookloop watchdog: rank 1 of 3 (host node7, pid 4001) hangs at step 3, in backward "
        "(graph.py:10): no heartbeat for 5.0 s; its beats were refused: it is not JSON "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "allowed: a JSON object (deadline 4.0 s, train.watchdog_seconds). Nothing saved: a "
        "checkpoint needs every rank; there is no checkpoint. Exiting with code 5."
    )
    why = "its beats were refused: it is a JSON list; allowed: a JSON object"
    rows = rank_rows(watch, 5.0)
    assert rows[2] == {"rank": 2, "state": "not started", "age_s": None, "refused": why}
    never = Watch(rank=0, world=3)  # its first value was already refused
    never.saw({0: beat(0, 1), 1: beat(1, 1)}, 0.0, {2: why})
    never.saw({0: beat(0, 2), 1: beat(1, 2)}, 5.0, {2: why})
    verdict = never.verdict(now=5.0, deadline=4.0)
    assert "rank 2 of 3 hangs before its first heartbeat: no heartbeat for 5.0 s; its beats " \
           "were refused: it is a JSON list" in message(verdict, 3, None)  # fmt: skip


# -- the sender fits its own beat ------------------------------------------------------------


def _deep(depth: int) -> str:
    return "".join(traceback.format_stack()) if depth <= 0 else _très_profond(depth - 1)


def _très_profond(depth: int) -> str:  # a non-ASCII name: six bytes a character in JSON
    return _deep(depth - 1)


def test_a_deep_stack_and_a_long_host_are_cut_by_the_sender_so_its_beat_is_taken():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 3000)
    try:
        stack = _deep(1600)
    finally:
        sys.setrecursionlimit(limit)
    hung = beat(host="h" * 2000, state="hung", stuck_s=5.0, stack=stack)
    assert len(stack) > MAX_STACK and len(json.dumps(hung)) > MAX_BEAT_BYTES  # uncut: refused
    sent = encode_beat(hung).encode()
    assert len(sent) <= MAX_BEAT_BYTES
    taken = check_beat(sent, 1)
    assert taken["host"] == "h" * 512
    cut, kept = taken["stack"].split("\n", 1)
    assert cut.startswith("[") and cut.endswith(" characters of outer frames cut]")
    assert stack.endswith(kept) and "in _deep" in kept.splitlines()[-2]  # the innermost frames
    assert kept.startswith("  File ")  # cut at a line's start
    assert set(json.loads(sent)) == set(FIELDS)


# -- rank 0's real watchdog thread against forged values in a real store ---------------------


def test_forged_values_for_rank_1_leave_rank_0_watching_and_it_names_silent_rank_2(tmp_path):
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    job = subprocess.run([sys.executable, JOB, "forged", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    said = job.stdout + job.stderr
    assert job.returncode == 5, said[-4000:]
    refusals = [line for line in said.splitlines() if "ignoring a beat of rank" in line]
    reasons = [line.split(": ", 2)[2].split(";")[0] for line in refusals]
    assert reasons == [  # once per reason, two values that are no JSON included
        "it is not JSON (Expecting value: line 1 column 1 (char 0))",
        "it is 1048576 bytes",
        "it says rank 0",
        "field 'deadline' is inf",
        "field 'state' is 'zombie'",
    ], said[-4000:]
    assert all("rank 1:" in line for line in refusals)
    assert "stopped watching" not in said and "rank 1 of 3" not in said
    assert "hookloop watchdog: rank 2 of 3 (host node]0;owned[2J7, pid 4002) hangs at step 3, " \
           "callback Up[1Aload (on_log): no heartbeat for " in said  # fmt: skip
    assert 'rank 2\'s training thread:\n  File "cb.py", line 3, in upload[31m' in said
    [line] = [
        ln for ln in (tmp_path / "progress.txt").read_text().splitlines() if "Rank hung" in ln
    ]
    assert "\tRank: 2\tHost: node]0;owned[2J7\t" in line
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[2]["host"] == "node]0;owned[2J7" and rows[2]["state"] == "running"
    for shown in (said, line, json.dumps(rows, ensure_ascii=False)):
        assert ESC not in shown


def test_ctl_status_text_shows_why_a_ranks_latest_beat_was_refused():
    from hookloop.control.cli import format_status

    rows = [
        {"rank": 0, "state": "running", "age_s": 0.5, "step": 3, "where": "step"},
        {"rank": 1, "state": "not started", "age_s": None, "refused": "not a JSON object"},
    ]
    shown = format_status({"job_id": "j", "pid": 1, "phase": "training", "step": 3, "epoch": 0,
                           "ranks": rows})  # fmt: skip
    lines = shown.splitlines()
    assert "rank 1      not started, never" in lines
    assert lines[lines.index("rank 1      not started, never") + 1] == (
        "            latest beat refused: not a JSON object"
    )
