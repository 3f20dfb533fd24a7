"""The watchdog names the rank that hangs: two gloo ranks whose rank 1 stops (SIGSTOP) or
loops forever in a callback, a run where nobody hangs, and the detection logic on a clock
of its own (hookloop.watchdog).

The two-rank jobs (tests/_watchdog_job.py) are started here, one process each with
torchrun's environment, not by torchrun: its agent would kill the others itself when one
exits, and hide which rank exited how. Every wait is bounded; every rank is killed and
reaped in a ``finally``, a stopped one included. Timing is asserted on the watchdog's own
measurements (what it prints), with the deadline short and the margins wide.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hookloop import Callback, CallbackContext, CallbackManager
from hookloop import distributed as hookloop_distributed
from hookloop.watchdog import (
    HUNG_EXIT,
    StepClock,
    Still,
    Watch,
    Where,
    deadline_for,
    message,
    waits_on_me,
    where_of,
)

JOB = str(Path(__file__).with_name("_watchdog_job.py"))
DEADLINE = 3.0  # train.watchdog_seconds in the two-rank jobs
#: Bounds on a whole job (start-up of torch on a loaded machine included), never reached
#: when the watchdog works: a test that fails fails, it does not hang.
JOB_TIMEOUT = 180


# -- two ranks ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def two_ranks(mode: str, out: Path, deadline: float = DEADLINE) -> Iterator[list[subprocess.Popen]]:
    """Both ranks of the job, each in a session of its own with its output in
    ``out/rankN.log``; on the way out every rank still there is killed and reaped."""
    out.mkdir(parents=True, exist_ok=True)
    port, procs = _free_port(), []
    src = str(Path(__file__).resolve().parent.parent / "src")
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
                "HOOKLOOP_JOBS_DIR": str(out / "jobs"),
            }  # fmt: skip
            with open(out / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, JOB, mode, str(out), f"train.watchdog_seconds={deadline}"],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                ))  # fmt: skip
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # a stopped process dies too
            proc.wait(timeout=60)


def _log(out: Path, rank: int) -> str:
    return (out / f"rank{rank}.log").read_text()


def _seconds(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text[-4000:]}"
    return float(found.group(1))


def _progress_lines(out: Path) -> list[list[str]]:
    text = (out / "progress.txt").read_text()
    return [line.split("\t") for line in text.splitlines() if "\tRank hung\t" in line]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "culprit", "why"),
    [("stop", 1, "no heartbeat for"),
     # rank 0 serves the store: the other rank's calls go unanswered, which names it
     ("stop-rank-0", 0, "its store stopped answering; no heartbeat for")],
)  # fmt: skip
def test_a_stopped_rank_is_named_by_the_other_which_exits_with_the_documented_code(
    tmp_path, mode, culprit, why
):
    witness = 1 - culprit
    with two_ranks(mode, tmp_path) as procs:
        code = procs[witness].wait(timeout=JOB_TIMEOUT)
        assert procs[culprit].poll() is None  # still there, stopped: only the test ends it
        said = _log(tmp_path, witness)
    assert code == HUNG_EXIT == 5, said[-4000:]
    host, pid = socket.gethostname(), procs[culprit].pid
    assert (
        f"hookloop watchdog: rank {culprit} of 2 (host {host}, pid {pid}) hangs at step 3, "
        f"callback StopAtStep (on_train_step_end): {why} "
    ) in said
    # The watchdog's own clock: named within 5 s of its deadline, gone within 15 s of the
    # last heartbeat (the stop).
    silent = _seconds(r"no heartbeat for ([\d.]+) s \(deadline 3\.0 s", said)
    assert DEADLINE <= silent <= DEADLINE + 5
    assert _seconds(r"exiting with code 5, ([\d.]+) s after the hang began", said) <= 15
    assert "Nothing saved: a checkpoint needs every rank" in said
    assert said.index("hangs at step 3") < said.index("exiting with code 5")
    [line] = _progress_lines(tmp_path)  # written once, by the witness
    assert line[4:9] == [f"Rank: {culprit}", f"Host: {host}", f"Pid: {pid}", "Iteration: 3",
                         "Where: callback StopAtStep (on_train_step_end)"]  # fmt: skip
    assert not (tmp_path / f"result-rank{witness}.json").exists()  # it did not go on


@pytest.mark.slow
def test_a_rank_looping_in_a_callback_is_named_with_its_stack_and_both_ranks_exit(tmp_path):
    with two_ranks("loop", tmp_path) as (rank0, rank1):
        codes = [rank0.wait(timeout=JOB_TIMEOUT), rank1.wait(timeout=JOB_TIMEOUT)]
        said, own = _log(tmp_path, 0), _log(tmp_path, 1)
    assert codes == [HUNG_EXIT, HUNG_EXIT], said[-4000:] + own[-4000:]
    assert f"rank 1 of 2 (host {socket.gethostname()}, pid {rank1.pid}) hangs at step 3" in said
    stuck = _seconds(r"callback LoopAtStep \(on_train_step_end\): stuck for ([\d.]+) s", said)
    assert DEADLINE <= stuck <= DEADLINE + 5
    stack = said[said.index("rank 1's training thread:") :]
    assert "in spin_forever" in stack and "in on_train_step_end" in stack
    assert "this rank (1) hangs at step 3, callback LoopAtStep" in own  # its own word too
    assert "in spin_forever" in own
    assert _seconds(r"exiting with code 5, ([\d.]+) s after the hang began", said) <= 15
    [line] = _progress_lines(tmp_path)
    assert line[4] == "Rank: 1" and line[9].startswith("Why: stuck for ")


@pytest.mark.slow
def test_a_run_where_nobody_hangs_finishes_and_a_rank_done_first_is_not_reported(tmp_path):
    # Rank 0's on_train_end lasts twice the deadline after rank 1 is done: rank 1 is not
    # reported, and rank 0, alone in its callback, waits on nobody. Meanwhile it reads its
    # status as `hookloop ctl JOB status` does.
    # A longer deadline than the hangs': a loaded machine must not make a false one.
    with two_ranks("plain", tmp_path, deadline=5.0) as (rank0, rank1):
        codes = [rank0.wait(timeout=JOB_TIMEOUT), rank1.wait(timeout=JOB_TIMEOUT)]
        logs = [_log(tmp_path, 0), _log(tmp_path, 1)]
    assert codes == [0, 0], logs
    assert not any("hookloop watchdog:" in log for log in logs)
    assert [json.loads((tmp_path / f"result-rank{r}.json").read_text())["step"]
            for r in range(2)] == [8, 8]  # fmt: skip
    assert not (tmp_path / "progress.txt").exists() or not _progress_lines(tmp_path)
    status = json.loads((tmp_path / "status.json").read_text())
    rows = {row["rank"]: row for row in status["ranks"]}
    assert rows[0]["state"] == "running" and rows[0]["where"] == "callback SlowEnd (on_train_end)"
    assert rows[1]["state"] == "finished" and rows[1]["step"] == 8
    assert rows[1]["pid"] == rank1.pid and rows[0]["age_s"] >= 0
    assert "rank 1      finished, " in status["text"]
    assert "step 8, callback SlowEnd (on_train_end)" in status["text"]


# -- the detection, on a clock of its own --------------------------------------------------


def beat(rank: int, seq: int, **fields) -> dict:
    """A running rank's beat, as the watchdog writes it."""
    return {
        "rank": rank, "host": "node7", "pid": 4000 + rank, "step": 3, "event": None,
        "callback": None, "collective": None, "frame": "backward (graph.py:10)",
        "time": 0.0, "seq": seq, "state": "running", "deadline": 4.0, "still_s": 0.0,
        "stuck_s": 0.0, "stack": None, **fields,
    }  # fmt: skip


def test_a_rank_whose_beats_stop_is_named_once_its_deadline_has_passed():
    watch = Watch(rank=0, world=3)
    watch.saw({0: beat(0, 1), 1: beat(1, 1), 2: beat(2, 1)}, now=100.0)
    watch.saw({0: beat(0, 2), 1: beat(1, 2), 2: beat(2, 1)}, now=100.5)  # rank 2 fell silent
    assert watch.verdict(now=104.0, deadline=4.0) is None  # silent 4.0 s: not yet past it
    for t in (104.5, 105.0):  # rank 1 keeps beating
        watch.saw({0: beat(0, 3), 1: beat(1, int(t * 10)), 2: beat(2, 1)}, now=t)
    verdict = watch.verdict(now=105.0, deadline=4.0)
    assert verdict is not None and verdict.rank == 2
    assert verdict.why == "no heartbeat for 5.0 s" and verdict.since == 100.0
    assert verdict.beat["pid"] == 4002


def test_the_larger_of_the_two_deadlines_applies_to_a_slower_rank():
    watch = Watch(rank=0, world=2)
    watch.saw({0: beat(0, 1), 1: beat(1, 1, deadline=30.0)}, now=0.0)
    assert watch.verdict(now=20.0, deadline=4.0) is None  # its own steps are slow
    assert watch.verdict(now=31.0, deadline=4.0).rank == 1


def test_a_rank_done_is_never_named_and_one_that_never_beat_is():
    watch = Watch(rank=1, world=3)
    watch.saw({0: beat(0, 1, state="finished"), 1: beat(1, 1), 2: None}, now=0.0)
    verdict = watch.verdict(now=60.0, deadline=4.0)
    assert verdict is not None and verdict.rank == 2 and not verdict.beat
    assert "before its first heartbeat" in message(verdict, 3, None)
    watch.saw({0: beat(0, 1, state="finished"), 1: beat(1, 2), 2: beat(2, 1, state="failed")},
              now=61.0)  # fmt: skip
    assert watch.verdict(now=120.0, deadline=4.0) is None


def test_a_rank_that_says_it_is_stuck_is_named_at_once_with_its_stack():
    watch = Watch(rank=0, world=2)
    stuck = beat(1, 9, state="hung", event="on_log", callback="Upload", stuck_s=4.5,
                 stack='  File "cb.py", line 3, in upload_forever\n')  # fmt: skip
    watch.saw({0: beat(0, 1), 1: stuck}, now=50.0)
    verdict = watch.verdict(now=50.0, deadline=4.0)
    assert verdict is not None and verdict.rank == 1 and verdict.since == 45.5
    text = message(verdict, world=2, latest="runs/a/checkpoints/step-00000002")
    assert text.splitlines()[0] == (
        "hookloop watchdog: rank 1 of 2 (host node7, pid 4001) hangs at step 3, callback "
        "Upload (on_log): stuck for 4.5 s (deadline 4.0 s, train.watchdog_seconds). Nothing "
        "saved: a checkpoint needs every rank; the latest checkpoint is "
        "runs/a/checkpoints/step-00000002. Exiting with code 5."
    )
    assert text.splitlines()[1:] == ["rank 1's training thread:",
                                     '  File "cb.py", line 3, in upload_forever']  # fmt: skip


def test_a_store_that_stops_answering_names_rank_0_unless_it_finished():
    watch = Watch(rank=1, world=2)
    watch.saw({0: beat(0, 1, collective="agree_flags"), 1: beat(1, 1)}, now=10.0)
    watch.unanswered(now=11.0)
    watch.unanswered(now=12.0)
    assert watch.verdict(now=13.5, deadline=4.0) is None  # rank 0 last seen 3.5 s ago
    verdict = watch.verdict(now=15.5, deadline=4.0)
    assert verdict is not None and verdict.rank == 0
    assert verdict.why == "its store stopped answering; no heartbeat for 5.5 s"
    assert "collective: agree_flags" in message(verdict, 2, None)
    done = Watch(rank=1, world=2)
    done.saw({0: beat(0, 1, state="finished"), 1: beat(1, 1)}, now=10.0)
    done.unanswered(now=11.0)
    assert done.verdict(now=60.0, deadline=4.0) is None


def test_a_rank_is_waited_on_only_by_a_still_rank_outside_a_callback_or_in_a_collective():
    waiting = beat(0, 1, still_s=3.0, collective="gather_objects", callback="Sync")
    assert waits_on_me([waiting], patience=2.0)
    assert waits_on_me([beat(0, 1, still_s=3.0)], patience=2.0)  # blocked in backward
    assert not waits_on_me([beat(0, 1, still_s=1.0)], patience=2.0)  # still moving
    assert not waits_on_me([beat(0, 1, still_s=3.0, callback="Upload")], patience=2.0)
    assert not waits_on_me([beat(0, 1, still_s=3.0, state="finished")], patience=2.0)


def test_the_automatic_deadline_follows_the_slowest_recent_step():
    clock = StepClock(recent=3)
    for step, t in [(1, 0.0), (2, 1.0), (3, 9.0), (4, 10.0), (5, 11.0)]:
        clock.observe(step, t)
    assert clock.slowest() == 8.0 and deadline_for("auto", clock.slowest()) == 24.0
    clock.observe(6, 12.0)  # the 8-second step is no longer among the last three
    assert clock.slowest() == 1.0 and deadline_for("auto", clock.slowest()) == 10.0
    assert deadline_for(2.5, 100.0) == 2.5 and deadline_for(0, 1.0) is None


def test_still_counts_from_the_last_change():
    still = Still()
    assert still.update("a", 1.0) == 0.0
    assert still.update("a", 3.5) == 2.5
    assert still.update("b", 4.0) == 0.0


# -- where the training thread is, read from its stack --------------------------------------


def _frame_of_thread_blocked_in(start, release: threading.Event) -> tuple[threading.Thread, Where]:
    ready = threading.Event()
    thread = threading.Thread(target=start, args=(ready,), daemon=True)
    thread.start()
    try:
        assert ready.wait(30)
        return thread, where_of(sys._current_frames()[thread.ident])
    finally:
        release.set()
        thread.join(30)


def test_where_names_the_event_and_callback_being_dispatched():
    release = threading.Event()

    class Blocks(Callback):
        def on_log(self, ctx: CallbackContext) -> None:
            self.ready.set()
            release.wait(30)

    blocks = Blocks()
    manager = CallbackManager([blocks])

    def train(ready: threading.Event) -> None:
        blocks.ready = ready
        manager.fire("on_log", CallbackContext())

    _, where = _frame_of_thread_blocked_in(train, release)
    assert (where.event, where.callback, where.collective) == ("on_log", "Blocks", None)
    assert where.describe() == "callback Blocks (on_log)"


def test_where_names_hookloops_collective_inside_a_callback(monkeypatch):
    release = threading.Event()
    ready_box: list[threading.Event] = []

    def all_gather_object(out, obj):  # a peer that never comes
        ready_box[0].set()
        release.wait(30)

    monkeypatch.setattr(hookloop_distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    manager = CallbackManager()
    manager.register("on_train_step_end", lambda ctx: hookloop_distributed.gather_objects(1))

    def train(ready: threading.Event) -> None:
        ready_box.append(ready)
        manager.fire("on_train_step_end", CallbackContext())

    _, where = _frame_of_thread_blocked_in(train, release)
    assert where.collective == "gather_objects" and where.event == "on_train_step_end"
    assert where.describe().startswith("collective: gather_objects in callback ")
