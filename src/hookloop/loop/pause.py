"""Pause and resume: hold a running job at a step boundary on every rank, then go on.

``hookloop ctl JOB pause`` files a ``pause`` request. Like any request it is agreed across
ranks at the end of a step, so every rank pauses after the same step: the handler marks
the pause due (:meth:`Pauses.ask`), and once the rest of the step's plan has run (a save
asked at the same step, say) the loop calls :func:`hold`, unless that plan ends training
(a stop filed at the same step) or a ``resume`` came with it. :func:`hold` waits on the
training thread: the process, the data position and
device memory stay as they are, the heartbeats and the control server go on. Every
:data:`POLL_S` seconds the ranks agree, in one small collective, whether anything was
filed on any rank (a request, a caught signal); when something was, they take the
requests together (:meth:`~hookloop.loop.schedule.Schedule.take_requests`) and act:

- ``resume``: every rank leaves the pause at the same moment and training goes on;
- ``stop`` / ``abort`` / a signal: training ends as it would at a step's end (a stop saves);
- ``set`` / ``unset`` and a ``save``: carried out while paused (a change is applied at the
  step the run is paused at, as if at that step's end); a log or evaluation waits.

The pause and the resume are recorded in ``changes.jsonl`` (``{"event": "pause"}``),
informational only: a resume or ``--replay`` does not pause again. The watchdog is told
(:attr:`hookloop.watchdog.Watchdog.paused`): a pause is not a hang, however long.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from hookloop.distributed import agree_flags, rank_info
from hookloop.loop.changes import append_change
from hookloop.requests import register_kind

register_kind("pause", "hold the job at this step's end on every rank until a resume")
register_kind("resume", "go on after a pause")

#: How often the paused ranks agree whether something was filed (seconds).
POLL_S = 0.2


@dataclass
class PauseState:
    """Whether the job is paused, since when and at which step (read by the server thread)."""

    paused: bool = False
    since: float | None = None
    step: int | None = None
    #: A pause was filed and the loop has not held yet (the server refuses a second one).
    asked: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"paused": self.paused, "paused_since": self.since, "paused_at_step": self.step}


class Pauses:
    """The pause state of one run, and the lock the server thread files pauses under."""

    def __init__(self) -> None:
        self.state = PauseState()
        self.lock = threading.Lock()
        #: The values of a ``pause`` agreed at this step's end, until the loop holds.
        self.due: dict[str, Any] | None = None

    def ask(self, values: dict[str, Any]) -> None:
        """The ``pause`` handler (every rank): hold once this step's plan has run."""
        self.due = dict(values)

    def take(self) -> dict[str, Any] | None:
        due, self.due = self.due, None
        return due

    def cancel(self) -> None:
        """The ``resume`` handler: a resume agreed with the pause (or with none) holds nothing."""
        self.due = None
        with self.lock:
            self.state.asked = False

    def check_pause(self) -> None:
        """A second pause is refused (``ValueError``, one line)."""
        with self.lock:
            if self.state.paused or self.state.asked:
                raise ValueError("pause: the job is already paused (resume it first)")
            self.state.asked = True

    def withdraw(self) -> None:
        """A pause checked, then refused before it was filed (the job was evaluating, say),
        is not asked: a later one is not refused as a second."""
        with self.lock:
            self.state.asked = False

    def check_resume(self) -> None:
        with self.lock:
            if not self.state.paused and not self.state.asked:
                raise ValueError("resume: the job is not paused")


def hold(trainer: Any, values: dict[str, Any]) -> None:
    """The ``pause`` handler: wait, agreeing with the other ranks, until a resume or an end."""
    parts, st = trainer.parts, trainer.progress
    pauses: Pauses = parts.live.pauses
    with pauses.lock:
        pauses.state = PauseState(True, time.time(), st.step)
    record_event(parts.live, "pause", values)
    parts.watchdog.paused = True
    try:
        while not _one_look(trainer):
            time.sleep(POLL_S)
    finally:
        parts.watchdog.paused = False
        with pauses.lock:
            pauses.state = PauseState()
    record_event(parts.live, "resume", {})


def _one_look(trainer: Any) -> bool:
    """Whether to leave the pause: agree whether anything was filed, and act on it."""
    parts, schedule, control = trainer.parts, trainer.schedule, trainer.control
    asked = [int(control.pending), int(parts.signals.caught is not None)]
    if trainer.progress.world_size > 1:
        asked = agree_flags(asked, parts.device)
    if not any(asked):
        return False
    requests = schedule.take_requests()
    for kind in ("set", "unset"):
        if kind in requests:
            trainer.act([(kind, requests[kind])])
    if requests.abort:
        trainer.act([("abort", {"reason": requests.abort, "failed": requests.failed})])
        return True
    reason = schedule.stop_reason(requests)
    if reason is not None:
        trainer.act([("stop", {"reason": reason, "failed": requests.failed})])
        return True
    if requests.save and trainer.checkpoints is not None:
        trainer.act([("save", {})])
    schedule.carry_over(requests)  # a log or an evaluation: after the resume
    return "resume" in requests


def record_event(live: Any, event: str, values: dict[str, Any]) -> None:
    """A pause or a resume in ``changes.jsonl`` (rank 0): informational, never replayed."""
    if live.run_dir is None or rank_info()[0] != 0:
        return
    record = {"id": f"{time.time_ns():020d}", "step": live.progress.step, "values": {},
              "changes": [], "client": str(values.get("client") or "unknown"),
              "time": time.time(), "event": event}  # fmt: skip
    append_change(live.run_dir.changes, record)
