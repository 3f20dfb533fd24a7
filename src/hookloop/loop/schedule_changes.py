"""Scheduled changes: a live ``set`` for a later step, recorded when filed, cancellable.

``hookloop ctl set JOB lr=1e-4 --at-step 5000`` files a ``set`` whose request carries
``at_step``. It is agreed across ranks like any ``set``; at the end of the step it was
agreed at, on every rank, :meth:`Scheduled.file`:

1. refuses it when that step has already passed (a step not after the current one);
2. applies it at once when the agreement falls exactly on its step;
3. otherwise appends its record to ``changes.jsonl`` now, at its step
   (``{"id", "step": 5000, "values", "filed_at": ..., ...}``), and files it for that
   step's end with :meth:`~hookloop.requests.Control.request_later`.

Because the record is written when the change is filed, a run killed before the step
and resumed (``--resume auto``) replays it at its step, like any recorded change.
``hookloop ctl JOB unset ID`` files an ``unset``: every rank forgets the change at the
same step, and a record ``{"cancels": ID}`` keeps a resume from replaying it.
"""

from __future__ import annotations

import time
from typing import Any

from hookloop.distributed import rank_info
from hookloop.loop.changes import append_change
from hookloop.loop.live_values import Setting, SettingError
from hookloop.requests import register_kind

register_kind("unset", "cancel a change scheduled for a later step")


class Scheduled:
    """The changes filed for later steps of one run (a part of its LiveSettings)."""

    def __init__(self, live: Any) -> None:
        self.live = live
        #: Changes filed for a later step and not yet applied: id -> {step, values, client}.
        self.pending: dict[str, dict[str, Any]] = {}
        #: Ids cancelled by ``unset`` (the loop skips them when their step comes).
        self.cancelled: set[str] = set()

    # -- the server's checks (its thread; one line each, nothing filed) -----------------
    def check_step(self, at_step: Any) -> int:
        """``at_step`` a step after the current one (``ValueError`` otherwise)."""
        step = self.live.progress.step
        if isinstance(at_step, bool) or not isinstance(at_step, int):
            raise ValueError(f"at_step must be a step number after {step}, got {at_step!r}")
        if at_step <= step:
            raise ValueError(
                f"at_step={at_step} is not after the current step {step}; give a later step"
            )
        return at_step

    def check_unset(self, ident: Any) -> str:
        """``ident`` a change still waiting for its step (``ValueError`` otherwise)."""
        if isinstance(ident, str) and ident in self.pending:
            return ident
        applied = {r["id"]: r["step"] for r in self.live.history}
        if isinstance(ident, str) and ident in applied:
            raise ValueError(f"unset: change {ident} was already applied at step {applied[ident]}")
        waiting = ", ".join(sorted(self.pending)) or "none"
        raise ValueError(f"unset: no scheduled change {ident!r}; scheduled now: {waiting}")

    # -- the loop's side (every rank) -------------------------------------------------
    def file(self, ident: str, asked: dict[str, Any]) -> bool:
        """Take a ``set`` agreed now: True when it is for a later step (recorded and filed
        for it, or refused); False when it is to be applied now."""
        if ident in self.cancelled:
            self.pending.pop(ident, None)
            self.live.decide(ident, {"id": ident, "step": self.live.progress.step, "applied": False,
                                     "reason": "cancelled"})  # fmt: skip
            return True
        at_step, step = asked.get("at_step"), self.live.progress.step
        if at_step is None or asked.get("replay") or at_step == step:
            return False
        if at_step < step:
            self.live.refuse(ident, asked, f"at_step={at_step} had passed when it was taken")
            return True
        values = self.live.check(asked["values"])  # a SettingError is refused by the caller
        client = str(asked.get("client") or "unknown")
        record = {"id": ident, "step": at_step, "values": values, "changes": [],
                  "client": client, "time": time.time(), "filed_at": step}  # fmt: skip
        self._append(record)
        later = {"values": values, "client": client, "replay": True}
        self.live.control.request_later(at_step, "set", **{ident: later})
        self.pending[ident] = {"id": ident, "step": at_step, "values": values, "client": client}
        self.live.decide(ident, {"id": ident, "step": step, "applied": None, "at_step": at_step})
        return True

    def unset(self, values: dict[str, Any]) -> None:
        """The ``unset`` handler's work: forget the change, record that it is cancelled."""
        ident = str(values["id"])
        if ident not in self.pending:
            return  # applied at this very step, before the unset was taken
        del self.pending[ident]
        self.cancelled.add(ident)
        step = self.live.progress.step
        self._append({"id": f"{time.time_ns():020d}", "step": step, "values": {}, "changes": [],
                      "client": str(values.get("client") or "unknown"), "time": time.time(),
                      "cancels": ident})  # fmt: skip

    def applied(self, ident: str) -> None:
        self.pending.pop(ident, None)

    def replayable(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records a resume replays: changes only (not a pause, not a cancellation),
        none cancelled; the scheduled ones among them are listed as pending again."""
        self.cancelled |= {r["cancels"] for r in records if "cancels" in r}
        changes = [
            r for r in records
            if "cancels" not in r and "event" not in r and r["id"] not in self.cancelled
        ]  # fmt: skip
        done = {r["id"] for r in self.live.history}
        for r in changes:
            if "filed_at" in r and r["step"] > self.live.progress.step and r["id"] not in done:
                keep = ("id", "step", "values", "client")
                self.pending[r["id"]] = {k: r.get(k) for k in keep}
        return changes

    def _append(self, record: dict[str, Any]) -> None:
        run_dir = self.live.run_dir
        if run_dir is not None and rank_info()[0] == 0:
            append_change(run_dir.changes, record)

    def to_json(self) -> list[dict[str, Any]]:
        pending = dict(self.pending)  # one copy: the loop may change it meanwhile
        return sorted(pending.values(), key=lambda r: (r["step"], r["id"]))


def max_steps_setting(progress: Any, train: Any) -> Setting:
    """``max_steps``: the step budget, never below the current step. The LR schedule keeps
    the length it was built with (set its own keys too to change it)."""

    def check(key: str, value: Any) -> int:
        step = progress.step
        if isinstance(value, bool) or not isinstance(value, int) or value < max(step, 1):
            raise SettingError(
                f"{key} must be a whole number of steps at least the current step "
                f"{step}, got {value!r}"
            )
        return value

    def put(value: int) -> None:
        progress.move_budget(value)
        train.max_steps = value

    return Setting("the step budget (not below the current step)", lambda: progress.max_steps,
                   put, check)  # fmt: skip
