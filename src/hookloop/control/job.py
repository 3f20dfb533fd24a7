"""A training job as the control server's thread sees it, and what it costs the loop.

The training thread does no work per step for the server. Step, epoch and sample
counters are plain integers the server thread reads straight from ``TrainState`` (a
single attribute read is atomic); metrics are copied into a small lock-protected
:class:`Snapshot` only at ``on_log`` and ``on_eval_end``; the step rate is sampled by
the server thread once a second. :class:`LiveJob` answers ``GET .../status`` from
them and files a command's requests on the loop's Control.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hookloop.control.commands import COMMANDS, SERVER_COMMANDS, CommandError
from hookloop.profile import current_profile

if TYPE_CHECKING:
    from hookloop.state import Control, TrainState

log = logging.getLogger("hookloop.control")

#: Logged records kept for the dashboard's charts.
HISTORY_LEN = 5000
_RATE_WINDOW_S = 30.0


def finite(value: Any) -> Any:
    """JSON-safe number: NaN/Inf become strings (JavaScript's JSON.parse rejects them)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else str(number)


def numbers(values: dict[str, Any] | None) -> dict[str, Any]:
    """``values`` with string keys and JSON-safe numbers (what the snapshot keeps)."""
    if not values:
        return {}
    return {str(k): finite(v) for k, v in values.items()}


class Snapshot:
    """What the training thread publishes for the server thread, behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.phase = "starting"
        self.started = time.time()
        self.logs: dict[str, Any] = {}
        self.logs_step: int | None = None
        self.eval: dict[str, Any] = {}
        self.eval_step: int | None = None
        self.checkpoint: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LEN)
        self.seq = 0
        self.filed: deque[dict[str, Any]] = deque(maxlen=20)
        self.stopping: str | None = None  # the stop/abort command already filed
        self.rate_samples: deque[tuple[float, int]] = deque()

    def record(self, kind: str, step: int, values: dict[str, Any]) -> None:
        with self.lock:
            self.seq += 1
            entry = {"seq": self.seq, "kind": kind, "step": step, "time": time.time()}
            entry.update(values)
            self.history.append(entry)
            if kind == "train":
                self.logs, self.logs_step = values, step
            else:
                self.eval, self.eval_step = values, step

    def since(self, after: int) -> tuple[list[dict[str, Any]], int]:
        with self.lock:
            if after >= self.seq:
                return [], self.seq
            return [r for r in self.history if r["seq"] > after], self.seq

    def sample_rate(self, now: float, step: int) -> None:
        samples = self.rate_samples
        samples.append((now, step))
        while len(samples) > 2 and now - samples[0][0] > _RATE_WINDOW_S:
            samples.popleft()

    def steps_per_second(self, now: float, step: int) -> float | None:
        samples = list(self.rate_samples)
        if not samples:
            return None
        t0, s0 = samples[0]
        if step < s0:  # counters went back (a resume inside the same process)
            return None
        return (step - s0) / (now - t0) if now - t0 >= 1.0 else None


@dataclass
class LiveJob:
    """The job a control server serves: what it reads for ``GET .../status`` and where it
    files commands. Built by the server when training starts."""

    job_id: str
    state: TrainState | None
    control: Control | None
    snapshot: Snapshot = field(default_factory=Snapshot)
    #: The loop's LiveSettings (hookloop.loop.live), or None: ``set`` is refused.
    settings: Any = None
    #: What other callbacks publish (e.g. StragglerDetection's report).
    user_state: dict[str, Any] = field(default_factory=dict)
    can_save: bool = False
    can_evaluate: bool = False

    def sample_rate(self) -> None:
        """Note the step counter now (the server thread does it once a second)."""
        if self.state is not None:
            self.snapshot.sample_rate(time.monotonic(), self.state.step)

    def file(
        self, command: str, values: dict[str, Any] | None = None, client: str = "unknown"
    ) -> int:
        """File ``command`` on the loop's Control; returns the step it was filed at."""
        spec = SERVER_COMMANDS[command]
        if command in ("pause", "resume", "unset"):
            checked = self.checked_step_command(command, values or {}, client)
            try:
                return self._file(command, checked)
            except CommandError:
                if command == "pause":  # refused after its check: no pause is asked
                    self.settings.pauses.withdraw()
                raise
        if spec.needs == "live settings":
            values = self.checked_settings(values or {}, client)
        return self._file(command, values or {})

    def checked_step_command(
        self, command: str, values: dict[str, Any], client: str
    ) -> dict[str, Any]:
        """A ``pause`` (not while paused), ``resume`` (only while paused) or ``unset`` (of a
        change still waiting for its step), checked (400 in one line), with its client."""
        live = self.settings
        if live is None:
            raise CommandError(f"{command}: this job's loop has no live settings", 409)
        try:
            if command == "pause":
                live.pauses.check_pause()
            elif command == "resume":
                live.pauses.check_resume()
            else:
                values = {"id": live.later.check_unset(values.get("id"))}
        except ValueError as err:
            raise CommandError(str(err)) from None
        return {**values, "client": client}

    def file_set(self, values: dict[str, Any], client: str) -> tuple[int, str]:
        """File a ``set``; returns the step it was filed at and its id (what
        ``settings.outcome(id, timeout)`` reports on once the loop has applied it)."""
        request = self.checked_settings(values, client)
        return self._file("set", request), next(iter(request))

    def _file(self, command: str, values: dict[str, Any]) -> int:
        snap, control, state = self.snapshot, self.control, self.state
        spec = SERVER_COMMANDS[command]
        requests = spec.requests(values)
        if not requests:  # Forgather's "status": nothing to file, whatever the phase
            return state.step if state is not None else 0
        if control is None or state is None or snap.phase not in ("training", "evaluating"):
            raise CommandError(f"the job is not training (it is {snap.phase})", 409)
        if spec.needs == "checkpoints" and not self.can_save:
            raise CommandError(
                f"{command}: this job has no output directory, so it cannot save checkpoints",
                409,
            )
        if spec.needs == "live settings" and self.settings is None:
            raise CommandError(f"{command}: this job's loop has no live settings", 409)
        if spec.needs == "eval data" and not self.can_evaluate:
            raise CommandError(f"{command}: this job has no evaluation data", 409)
        with snap.lock:
            if snap.stopping is not None:
                raise CommandError(
                    f"{command}: the job is already ending ({snap.stopping} was filed)", 409
                )
            step = state.step
            control.request_all(requests)
            if spec.ends:
                snap.stopping = command
            snap.filed.append({"command": command, "step": step, "time": time.time()})
        log.info("control: %s filed at step %d", command, step)
        return step

    def checked_settings(self, values: dict[str, Any], client: str) -> dict[str, Any]:
        """A ``set``'s values checked against the run (400 naming the key), as the request
        the loop applies: one entry keyed by a time-ordered id."""
        live = self.settings
        if live is None:
            raise CommandError("set: this job's loop has no live settings", 409)
        values = dict(values)
        at_step = values.pop("at_step", None)
        try:
            checked = live.check(values)
            if at_step is not None:
                at_step = live.later.check_step(at_step)
        except ValueError as err:
            raise CommandError(f"set: {err}") from None
        ident = f"{time.time_ns():020d}"
        later = {} if at_step is None else {"at_step": at_step}
        return {ident: {"values": checked, "client": client, **later}}

    def status(self) -> dict[str, Any]:
        """``GET .../status``: Forgather's keys, then hookloop's."""
        state, snap = self.state, self.snapshot
        now = time.monotonic()
        step = state.step if state is not None else 0
        max_steps = state.max_steps if state is not None else None
        rate = snap.steps_per_second(now, step)
        eta = None
        if rate and max_steps is not None:
            eta = max(max_steps - step, 0) / rate
        with snap.lock:
            now_s = time.time()
            out = {  # Forgather's keys first, in its order, then hookloop's
                "job_id": self.job_id,
                "status": "running" if snap.phase in ("training", "evaluating") else snap.phase,
                "timestamp": now_s,
                "global_step": step,
                "epoch": state.epoch if state is not None else 0,
                "max_steps": max_steps,
                "pid": os.getpid(),
                "phase": snap.phase,
                "step": step,
                "num_epochs": state.num_epochs if state is not None else None,
                "samples": state.samples if state is not None else 0,
                "elapsed_s": round(time.time() - snap.started, 3),
                "steps_per_s": round(rate, 3) if rate is not None else None,
                "eta_s": round(eta, 1) if eta is not None else None,
                "metrics": snap.logs,
                "metrics_step": snap.logs_step,
                "eval": snap.eval,
                "eval_step": snap.eval_step,
                "checkpoint": snap.checkpoint,
                # the divergences rolled back so far (hookloop.checkpoint.rewind), oldest first
                "rewinds": [r.to_json() for r in state.rewinds] if state is not None else [],
                # StragglerDetection's latest report (replaced whole, never mutated), or None
                "stragglers": self.user_state.get("stragglers"),
                # each rank's last heartbeat as the watchdog read it (hookloop.watchdog), or None
                "ranks": _rank_beats(),
                "stopping": snap.stopping,
                # pause / resume (hookloop.loop.pause): paused, since when, at which step
                **(self.settings.pauses.state.to_json() if self.settings is not None else {}),
                # the changes filed for a later step (set with at_step), soonest first
                "scheduled": self.settings.later.to_json() if self.settings is not None else [],
                # the values `set` can change now, and the changes applied so far
                "settings": self.settings.values() if self.settings is not None else None,
                "changes": list(self.settings.history[-20:]) if self.settings is not None else [],
                # the `set`s refused when the loop applied them (with why), newest last
                "refused": list(self.settings.refused[-20:]) if self.settings is not None else [],
                "history_seq": snap.seq,
                "recent_commands": list(snap.filed),
                "can_save": self.can_save,
                "can_evaluate": self.can_evaluate,
                "commands": list(COMMANDS),
                "time": now_s,
            }
            for key, value in snap.logs.items():  # and the latest log's keys, flat, as Forgather
                out.setdefault(key, value)
        profile = current_profile()  # callbacks.profile=true: the cost report per callback
        out["callback_profile"] = profile.rows() if profile is not None else None
        return out


def _rank_beats() -> Any:
    """The watchdog's table of beats, when a run in this process loaded it (importing it
    here would load torch into commands that only talk to a server)."""
    watchdog = sys.modules.get("hookloop.watchdog")
    return watchdog.rank_beats() if watchdog is not None else None
