"""Name the rank that hangs, instead of waiting for the process group's timeout.

When one rank stops (SIGSTOP, a machine that froze), deadlocks in a collective or
loops forever in a callback, the others wait in their next collective until the
process group's timeout and then fail naming nobody. So each rank of a multi-rank run
runs one daemon thread beside training. Every half second it *beats*: it writes what
its training thread is doing (rank, host, pid, step, the event and callback being
dispatched or the hookloop collective it waits in, the time) into a side channel, and
reads every other rank's beat.

Nothing on the hot path records anything: the thread reads the training thread's stack
(``sys._current_frames()``), where the dispatch's and the collectives' own frames say
where it is (:func:`hookloop.manager.dispatch_in`, :func:`hookloop.distributed.collective_in`).

The side channel is a ``torch.distributed.TCPStore`` that rank 0 serves on a free port,
its address broadcast once when training starts. Not a ``FileStore`` in the run
directory: that is one file every call locks and rereads and every write grows (two
beats a second per rank, for days), it needs a file system every host shares, and a
stopped rank holding its lock would stop every watchdog with it. A TCPStore is served by
a thread of its own, answers while rank 0's training thread is busy, and every call has a
timeout: when rank 0 itself stops, the calls time out, and that names rank 0.
Anyone who reaches that port may write it, so each value read is checked first
(:mod:`hookloop.watchdog_beats`): one that is no beat is ignored and said once, and a rank
whose values stay refused is silent, named with the reason once the deadline passes.

A rank hangs (:meth:`Watch.verdict`, :func:`waits_on_me`) when

- its beats stop for longer than the deadline (stopped, killed, or holding the GIL);
- it stays in one callback longer than the deadline while another rank waits for it:
  its own watchdog sees this, and publishes its training thread's stack with its beat;
- it is rank 0 and its store stops answering for longer than the deadline.

A rank that finished (or failed with an error of its own) says so in its last beat and
is not watched any more; a paused one (:mod:`hookloop.loop.pause`) beats ``paused`` and
is never taken for stuck. The deadline is ``train.watchdog_seconds``: ``auto`` is
``max(10 s, 3 x the slowest of the last 20 steps)``, null or 0 turns the watchdog off.

Then every rank still running prints one message naming the culprit (rank, host, pid,
step, where, and its stack when known); the lowest of them appends it to
``progress.txt``. Nothing is saved: every checkpoint needs a collective across all
ranks, which would hang too. The watchdog thread then ends the process with exit code
:data:`HUNG_EXIT` (``os._exit`` after flushing); the stuck rank, when its watchdog still
runs, does the same once the others have read its stack.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from hookloop.distributed import broadcast_object, collective_in
from hookloop.manager import dispatch_in
from hookloop.rundir import RunDir
from hookloop.state import Progress
from hookloop.watchdog_beats import BeatReader, encode_beat, waits_on_me

#: The exit code of a rank that ends because a rank hangs (the culprit's too).
HUNG_EXIT = 5
BEAT_SECONDS = 0.5
#: ``auto``: the deadline is max(AUTO_FLOOR, AUTO_FACTOR x the slowest of RECENT_STEPS steps).
AUTO_FLOOR, AUTO_FACTOR, RECENT_STEPS = 10.0, 3.0, 20
#: How long a store call may take before rank 0 counts as not answering.
STORE_TIMEOUT = timedelta(seconds=3)
#: How long a stuck rank waits for the others to read its stack before it exits.
ACK_SECONDS = 5.0
PREFIX = "hookloop/watchdog"
PROGRESS_LINE = "Rank hung"


# -- where the training thread is ---------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """What a thread is doing: the event and callback being dispatched, the hookloop
    collective it waits in, and its innermost Python frame (``function (file:line)``)."""

    event: str | None = None
    callback: str | None = None
    collective: str | None = None
    frame: str | None = None

    @classmethod
    def of_beat(cls, beat: Mapping[str, Any]) -> Where:
        """Where a beat says its rank was."""
        return cls(*(beat.get(key) for key in ("event", "callback", "collective", "frame")))

    def describe(self) -> str:
        """``collective: agree_flags``, ``callback Foo (on_log)``, both, or the frame."""
        parts = []
        if self.collective:
            parts.append(f"collective: {self.collective}")
        if self.callback:
            parts.append(f"callback {self.callback} ({self.event})")
        if not parts:
            parts.append(f"in {self.frame}" if self.frame else "nowhere known")
        return " in ".join(parts)


def where_of(frame: FrameType | None) -> Where:
    """Where the thread whose innermost frame is ``frame`` is."""
    if frame is None:
        return Where()
    dispatch = dispatch_in(frame)
    event, callback = dispatch if dispatch is not None else (None, None)
    code = frame.f_code
    line = f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})"
    return Where(event, callback, collective_in(frame), line)


# -- the pure parts: clocks, the deadline, the verdict -------------------------------------


class StepClock:
    """How long recent steps took, from the step counter read at each beat (a jump of
    several steps between two beats counts as one step of that length: it errs long)."""

    def __init__(self, recent: int = RECENT_STEPS) -> None:
        self._durations: deque[float] = deque(maxlen=recent)
        self._step: int | None = None
        self._since = 0.0

    def observe(self, step: int, now: float) -> None:
        if step != self._step:
            if self._step is not None:
                self._durations.append(now - self._since)
            self._step, self._since = step, now

    def slowest(self) -> float:
        return max(self._durations, default=0.0)


def deadline_for(setting: float | str | None, slowest_step: float) -> float | None:
    """Seconds a rank may miss beats (or stay in one callback) before it hangs; None: off.

    >>> deadline_for("auto", 1.0), deadline_for("auto", 6.0), deadline_for(4, 60.0)
    (10.0, 18.0, 4.0)
    >>> deadline_for(None, 1.0), deadline_for(0, 1.0)
    (None, None)
    """
    if setting is None or setting == 0:
        return None
    if setting == "auto":
        return max(AUTO_FLOOR, AUTO_FACTOR * slowest_step)
    return float(setting)


class Still:
    """How long a value has stayed the same, on the clock it is given."""

    def __init__(self) -> None:
        self._value: object = object()
        self._since = 0.0

    def update(self, value: object, now: float) -> float:
        if value != self._value:
            self._value, self._since = value, now
        return now - self._since


@dataclass(frozen=True)
class Verdict:
    """Rank ``rank`` hangs: ``why`` (one phrase), its last ``beat`` (empty: it never
    beat), since when (on the watcher's clock), and the deadline it broke."""

    rank: int
    why: str
    beat: Mapping[str, Any]
    since: float
    deadline: float


class Watch:
    """What one rank knows of the others' beats, on a clock it is given: no thread, no
    store (the watchdog feeds it; tests feed it by hand)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.beats: dict[int, Mapping[str, Any]] = {}
        self.seen: dict[int, float] = {}  # when each rank's beat last changed, our clock
        self.refused: Mapping[int, str] = {}  # why a rank's latest value was no beat
        self._unanswered_since: float | None = None

    def saw(
        self, beats: Mapping[int, Mapping[str, Any] | None], now: float,
        refused: Mapping[int, str] | None = None,
    ) -> None:  # fmt: skip
        """Checked beats read from the store (None: that rank has not beaten yet), and why
        the values of ``refused`` ranks were no beats (they count as silent)."""
        self.refused = dict(refused or {})
        for rank in self.refused:  # a rank whose first value is refused is silent from now
            self.seen.setdefault(rank, now)
        for rank, beat in beats.items():
            old = self.beats.get(rank)
            if beat is None:
                self.seen.setdefault(rank, now)
            elif old is None or old["seq"] != beat["seq"]:
                self.seen[rank] = now
                self.beats[rank] = beat
        self._unanswered_since = None

    def unanswered(self, now: float) -> None:
        """The store did not answer this time."""
        if self._unanswered_since is None:
            self._unanswered_since = now

    def done(self, rank: int) -> bool:
        beat = self.beats.get(rank)
        return beat is not None and beat["state"] in ("finished", "failed")

    def verdict(self, now: float, deadline: float) -> Verdict | None:
        """The rank that hangs, or None while every other rank is fine."""
        others = [r for r in range(self.world) if r != self.rank and not self.done(r)]
        for rank in others:
            beat = self.beats.get(rank)
            if beat is not None and beat["state"] == "hung":
                stuck = float(beat["stuck_s"])
                return Verdict(rank, f"stuck for {stuck:.1f} s", beat, now - stuck,
                               float(beat["deadline"]))  # fmt: skip
        since = self._unanswered_since
        if since is not None:  # nothing could be read: only the store's host can be named
            host = self.beats.get(0, {})
            limit = max(deadline, float(host.get("deadline") or 0.0))
            silent = now - self.seen.get(0, since)
            if 0 not in others or silent <= limit:
                return None
            return Verdict(0, f"its store stopped answering; no heartbeat for {silent:.1f} s",
                           host, now - silent, limit)  # fmt: skip
        for rank in others:
            beat = self.beats.get(rank, {})
            limit = max(deadline, float(beat.get("deadline") or 0.0))
            silent = now - self.seen.get(rank, now)
            if silent > limit:
                why = "; ".join([f"no heartbeat for {silent:.1f} s", *self._refusal(rank)])
                return Verdict(rank, why, beat, now - silent, limit)
        return None

    def _refusal(self, rank: int) -> list[str]:
        return [self.refused[rank]] if rank in self.refused else []


def message(verdict: Verdict, world: int, latest: str | None) -> str:
    """What every rank still running prints: the culprit, where, why, what is saved."""
    beat = verdict.beat
    where = Where.of_beat(beat)
    who = f"rank {verdict.rank} of {world}"
    if beat:
        who += f" (host {beat['host']}, pid {beat['pid']})"
    at = f" at step {beat['step']}, {where.describe()}" if beat else " before its first heartbeat"
    saved = f"the latest checkpoint is {latest}" if latest else "there is no checkpoint"
    lines = [
        f"hookloop watchdog: {who} hangs{at}: {verdict.why} (deadline "
        f"{verdict.deadline:.1f} s, train.watchdog_seconds). Nothing saved: a checkpoint "
        f"needs every rank; {saved}. Exiting with code {HUNG_EXIT}."
    ]
    if beat.get("stack"):
        lines.append(f"rank {verdict.rank}'s training thread:\n{beat['stack'].rstrip()}")
    return "\n".join(lines)


# -- the part ------------------------------------------------------------------------------


class Watchdog:
    """Beats for this rank and watches the others while training runs (world > 1 and
    ``train.watchdog_seconds`` not off); see the module doc. ``start()`` is called on
    the training thread on every rank alike (it broadcasts the store's address)."""

    def __init__(
        self,
        progress: Progress,
        setting: float | str | None,
        run_dir: RunDir | None = None,
        beat_seconds: float = BEAT_SECONDS,
    ) -> None:
        self.progress, self.setting, self.run_dir = progress, setting, run_dir
        self.beat_seconds = beat_seconds
        self._calls = StoreCalls(None)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._training_thread = 0
        self._seq = 0
        self._steps, self._still, self._stuck = StepClock(), Still(), Still()
        self._watch, self._reader = Watch(0, 1), BeatReader(self._say)
        self._deadline: float = AUTO_FLOOR
        self.paused = False  # the job is paused (hookloop.loop.pause): never taken for stuck

    def start(self, store: Any = None) -> None:
        """Open the store (rank 0 serves it; or use ``store``, its keys set), beat once,
        and start the thread."""
        rank, world = self.progress.rank, self.progress.world_size
        if world <= 1 or deadline_for(self.setting, 0.0) is None or self._thread is not None:
            return
        self._training_thread = threading.get_ident()
        self._calls = StoreCalls(store if store is not None else _open_store(rank, world))
        self._watch, self._reader = Watch(rank, world), BeatReader(self._say)
        self._stopping.clear()
        self._beat(time.monotonic())
        self._thread = threading.Thread(target=self._run, name="hookloop-watchdog", daemon=True)
        self._thread.start()

    def where(self) -> Where:
        """Where the training thread is now."""
        return where_of(sys._current_frames().get(self._training_thread))

    def stop(self, error: BaseException | None = None) -> None:
        """Training ended: beat once more, ``finished`` (or ``failed``, with ``error``), so
        no rank takes this one for hung. Rank 0 serves the store, so it keeps watching
        until every rank has finished (at most the deadline)."""
        if self._thread is None:
            return
        state = "finished" if error is None else "failed"
        self._stopping.set()
        self._thread.join(timeout=STORE_TIMEOUT.total_seconds() + 1)
        self._post(self._beat_record(time.monotonic(), state))
        if self.progress.rank == 0:
            self._wait_for_the_others(patience=None if error is None else 4 * self.beat_seconds)
        self._thread, self._calls = None, StoreCalls(None)
        publish(None)

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.wait(self.beat_seconds):
            try:
                self._tick(time.monotonic())
            except Exception as exc:  # the watchdog must never take training down
                self._say(f"hookloop watchdog: stopped watching: {type(exc).__name__}: {exc}")
                return

    def _tick(self, now: float) -> None:
        beat = self._beat(now)
        self._read(now)
        if beat["state"] == "hung":
            self._give_up(beat)
            return
        verdict = self._watch.verdict(now, self._deadline)
        if verdict is not None:
            self._report(verdict)

    def _beat(self, now: float) -> dict[str, Any]:
        """Sample the training thread, decide whether it is stuck, post the beat."""
        frame = sys._current_frames().get(self._training_thread)
        where, step = where_of(frame), self.progress.step
        self._steps.observe(step, now)
        self._deadline = deadline_for(self.setting, self._steps.slowest()) or AUTO_FLOOR
        still = self._still.update((step, where), now)
        stuck = self._stuck.update((step, where.event, where.callback), now)
        state = "paused" if self.paused else "running"
        beat = self._beat_record(now, state, where, still, stuck if where.callback else 0.0)
        peers = [b for r, b in self._watch.beats.items() if r != self.progress.rank]
        stuck = stuck if state == "running" else 0.0  # a pause is no hang
        if where.callback and stuck > self._deadline and waits_on_me(peers, self._deadline / 2):
            beat["state"] = "hung"
            beat["stack"] = "".join(traceback.format_stack(frame))
        del frame
        self._post(beat)
        return beat

    def _beat_record(
        self, now: float, state: str, where: Where | None = None, still: float = 0.0,
        stuck: float = 0.0,
    ) -> dict[str, Any]:  # fmt: skip
        where = where or Where()
        self._seq += 1
        return {
            "rank": self.progress.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "step": self.progress.step, "event": where.event, "callback": where.callback,
            "collective": where.collective, "frame": where.frame, "time": time.time(),
            "seq": self._seq, "state": state, "deadline": self._deadline,
            "still_s": round(still, 3), "stuck_s": round(stuck, 3), "stack": None,
        }  # fmt: skip

    def _post(self, beat: Mapping[str, Any]) -> None:
        key, value = f"{PREFIX}/beat/{beat['rank']}", encode_beat(beat)
        self._calls.call(lambda store: store.set(key, value))  # no answer: _read says so

    def _read(self, now: float) -> None:
        keys = [f"{PREFIX}/beat/{r}" for r in range(self.progress.world_size)]
        raw = self._calls.call(lambda store: store.multi_get(keys))
        if raw is None:
            self._watch.unanswered(now)
            return
        self._watch.saw(self._reader.read(raw), now, self._reader.refused)
        publish(rank_rows(self._watch, now))

    # -- acting ----------------------------------------------------------------------------
    def _report(self, verdict: Verdict) -> None:
        """Another rank hangs: say so, let the stuck one go, exit."""
        text = message(verdict, self.progress.world_size, self._latest_checkpoint())
        self._say(text)
        running = [r for r in range(self.progress.world_size) if r != verdict.rank]
        if self.progress.rank == min(running):
            self._append_progress(verdict)
        self._calls.call(lambda store: store.add(f"{PREFIX}/read/{verdict.rank}", 1))
        if self.progress.rank == 0:  # the store's host: the others are still reading it
            self._linger(verdict, running)
        after = time.monotonic() - verdict.since
        self._end(f"exiting with code {HUNG_EXIT}, {after:.1f} s after the hang began")

    def _linger(self, verdict: Verdict, running: list[int]) -> None:
        """Keep the store up (bounded) until every other rank still running has read the
        verdict, and a stuck culprit has seen that they did."""
        readers = sum(1 for r in running if not self._watch.done(r))
        gone = [f"{PREFIX}/gone/{verdict.rank}"] if verdict.beat.get("state") == "hung" else []
        until = time.monotonic() + ACK_SECONDS
        while time.monotonic() < until:
            read = self._calls.call(lambda store: store.add(f"{PREFIX}/read/{verdict.rank}", 0))
            left = self._calls.call(lambda store: store.check(gone)) if gone else True
            if read is None or (read >= readers and left):
                return
            time.sleep(0.05)

    def _give_up(self, beat: Mapping[str, Any]) -> None:
        """This rank is the stuck one: say where, wait (bounded) until the others have read
        its stack, exit."""
        where = Where.of_beat(beat)
        self._say(
            f"hookloop watchdog: this rank ({beat['rank']}) hangs at step {beat['step']}, "
            f"{where.describe()}: stuck for {beat['stuck_s']:.1f} s while other ranks wait "
            f"(deadline {beat['deadline']:.1f} s, train.watchdog_seconds). Its training "
            f"thread:\n{str(beat['stack']).rstrip()}"
        )
        waiting = sum(1 for r in range(self.progress.world_size) if not self._watch.done(r)) - 1
        until = time.monotonic() + ACK_SECONDS
        while time.monotonic() < until:
            read = self._calls.call(lambda store: store.add(f"{PREFIX}/read/{beat['rank']}", 0))
            if read is None or read >= waiting:
                break
            time.sleep(0.05)
        self._calls.call(lambda store: store.set(f"{PREFIX}/gone/{beat['rank']}", "1"))
        self._end(f"exiting with code {HUNG_EXIT}, {beat['stuck_s']:.1f} s after the hang began")

    def _end(self, last_words: str) -> None:
        self._say(f"hookloop watchdog: {last_words}")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed stream: nothing to flush
                stream.flush()
        os._exit(HUNG_EXIT)

    def _say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def _append_progress(self, verdict: Verdict) -> None:
        if self.run_dir is None or not self.run_dir.root.is_dir():
            return
        line = progress_line(verdict, self.progress.world_size, time.time())
        try:
            with open(self.run_dir.progress_log, "a") as f:
                f.write(line)
        except OSError as err:
            self._say(f"hookloop watchdog: could not append to progress.txt: {err}")

    def _latest_checkpoint(self) -> str | None:
        if self.run_dir is None:
            return None
        try:
            name = (self.run_dir.checkpoints / "latest").read_text().strip()
        except OSError:
            return None
        return str(self.run_dir.checkpoints / name) if name else None

    def _wait_for_the_others(self, patience: float | None) -> None:
        """Rank 0 keeps its store up until every rank has said it finished, for at most
        ``patience`` seconds (None: the deadline), watching them meanwhile."""
        wait = max(self._deadline, 4 * self.beat_seconds) if patience is None else patience
        until = time.monotonic() + wait
        while time.monotonic() < until:
            self._read(time.monotonic())
            others = range(1, self.progress.world_size)
            if all(self._watch.done(r) for r in others):
                return
            verdict = self._watch.verdict(time.monotonic(), self._deadline)
            if verdict is not None:
                self._report(verdict)
                return
            time.sleep(self.beat_seconds / 2)


def progress_line(verdict: Verdict, world: int, now: float) -> str:
    """The ``progress.txt`` line (:mod:`hookloop.callbacks.progress_log`'s format)."""
    beat = verdict.beat
    where = Where.of_beat(beat)
    job = os.environ.get("SLURM_JOB_ID") or f"local-{os.getpid()}"
    fields = [
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)), f"Job ID: {job}",
        f"# GPUs: {world}", PROGRESS_LINE, f"Rank: {verdict.rank}",
        f"Host: {beat.get('host', '?')}", f"Pid: {beat.get('pid', '?')}",
        f"Iteration: {beat.get('step', '?')}", f"Where: {where.describe()}",
        f"Why: {verdict.why}", f"Exit code: {HUNG_EXIT}",
    ]  # fmt: skip
    return "\t".join(fields) + "\n"


class StoreCalls:
    """Store calls that give up after :data:`STORE_TIMEOUT`. A TCPStore call whose server
    was stopped (SIGSTOP) outlives its own timeout (the connection stays open), so each
    runs on a daemon thread of its own; while one is still stuck, later calls give up at
    once. A call that fails or gives up returns None."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._stuck: threading.Event | None = None

    def call(self, fn: Callable[[Any], Any]) -> Any:
        if self.store is None or (self._stuck is not None and not self._stuck.is_set()):
            return None
        done, box = threading.Event(), []

        def run() -> None:
            try:
                box.append(fn(self.store))
            except (RuntimeError, ValueError):  # torch's store errors (DistError and kin)
                pass
            finally:
                done.set()

        threading.Thread(target=run, name="hookloop-watchdog-store", daemon=True).start()
        if not done.wait(STORE_TIMEOUT.total_seconds() + 0.5):
            self._stuck = done
            return None
        return box[0] if box else None


def _open_store(rank: int, world: int) -> Any:
    """Rank 0 serves a TCPStore on a free port; every rank learns where in one broadcast."""
    store = None
    address: tuple[str, int] | None = None
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, timeout=STORE_TIMEOUT,
                              wait_for_workers=False)  # fmt: skip
        for r in range(world):  # every key exists from the start: a read never waits
            store.set(f"{PREFIX}/beat/{r}", "null")
        address = (_reachable_host(), store.port)
    address = broadcast_object(address)
    if store is None:
        host, port = address
        store = dist.TCPStore(host, port, world, is_master=False, timeout=STORE_TIMEOUT)
    return store


def _reachable_host() -> str:
    """The address other ranks reach rank 0 at: torchrun's MASTER_ADDR on rank 0's host."""
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


# -- what `hookloop ctl JOB status` shows ---------------------------------------------------

_published: list[dict[str, Any]] | None = None
_lock = threading.Lock()


def publish(rows: list[dict[str, Any]] | None) -> None:
    global _published
    with _lock:
        _published = rows


def rank_beats() -> list[dict[str, Any]] | None:
    """Each rank's last beat as this process's watchdog read it (None: no watchdog runs):
    rank, host, pid, state, step, where, its age in seconds, and ``refused``: why its
    latest value was no beat, when it was not."""
    with _lock:
        return None if _published is None else [dict(row) for row in _published]


def rank_rows(watch: Watch, now: float) -> list[dict[str, Any]]:
    """The rows of :func:`rank_beats`, from what ``watch`` saw by ``now``."""
    rows = []
    for rank in range(watch.world):
        beat = watch.beats.get(rank)
        row: dict[str, Any] = {"rank": rank, "state": "not started", "age_s": None}
        if beat is not None:
            moving = beat["state"] in ("running", "hung")
            row = {
                "rank": rank, "host": beat["host"], "pid": beat["pid"], "state": beat["state"],
                "step": beat["step"], "where": Where.of_beat(beat).describe() if moving else "-",
                "age_s": round(now - watch.seen.get(rank, now), 1),
            }  # fmt: skip
        if rank in watch.refused:  # its latest value was no beat: why
            row["refused"] = watch.refused[rank]
        rows.append(row)
    return rows
