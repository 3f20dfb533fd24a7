"""The workers a DiLoCo server knows: who is registered (each with the secret
``/register`` issued, :mod:`hookloop.diloco.membership`), how many contributions of
each were refused in a row, and who was evicted for it.

A request under an id it does not hold is answered 403, one under an id not
registered 404, one under an evicted id 409: a :class:`ProtocolError` each, counted
against nobody.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hookloop.control.service import HttpError
from hookloop.diloco.membership import Caller, WorkerInfo, check_join, check_member

log = logging.getLogger("hookloop.diloco")


class ProtocolError(HttpError):
    """A request the DiLoCo server refuses; ``status`` is its HTTP code."""


class Roster:
    """The registered workers (``workers``), refusals in a row (``refusals``), and the
    evicted ids with the last reason (``evicted``); ``deaths`` counts the workers gone."""

    def __init__(self, *, max_refusals: int, allow_unbound: bool) -> None:
        self.max_refusals = max_refusals
        self.allow_unbound = allow_unbound
        self.workers: dict[str, WorkerInfo] = {}
        self.refusals: dict[str, int] = {}
        self.evicted: dict[str, str] = {}
        self.deaths = 0

    def check_not_evicted(self, worker_id: str) -> None:
        reason = self.evicted.get(worker_id)
        if reason is not None:
            raise ProtocolError(
                f"worker {worker_id} was evicted after {self.max_refusals} refused "
                f"contributions (last: {reason[:300]}); fix the worker and start it under "
                "a new worker id",
                409,
            )

    def member(self, worker_id: str, caller: Caller | None) -> WorkerInfo:
        """The registration ``caller`` may act for, or 404/403 (it counts nothing)."""
        info = self.workers.get(worker_id)
        refusal = check_member(worker_id, info, caller or Caller())
        if refusal is not None:
            log.warning("diloco: refused a request under %s: %s", worker_id[:200],
                        refusal.message)  # fmt: skip
            raise ProtocolError(refusal.message, refusal.status)
        assert info is not None
        return info

    def admit(self, worker_id: str, info: dict[str, Any], caller: Caller) -> None:
        """Register ``worker_id`` (again: it keeps its secret), or 403/409 saying why not."""
        self.check_not_evicted(worker_id)
        old = self.workers.get(worker_id)
        refusal = check_join(worker_id, old, caller, allow_unbound=self.allow_unbound)
        if refusal is not None:
            log.warning("diloco: refused to register %s: %s", worker_id[:200], refusal.message)
            raise ProtocolError(refusal.message, refusal.status)
        hostname = info.get("hostname", "unknown")
        extra = info.get("extra", {})
        now = time.time()
        new = WorkerInfo(
            worker_id, str(hostname)[:200], now, now,
            extra=extra if isinstance(extra, dict) else {}, peer=caller.peer,
            bound=caller.wants_binding,
        )  # fmt: skip
        if old is not None:  # the same worker again: it keeps its secret (and binding)
            log.info("diloco: worker %s registers again", worker_id)
            new.secret, new.peer, new.bound = old.secret, old.peer, old.bound or new.bound
        self.workers[worker_id] = new

    def remove(self, worker_id: str) -> bool:
        """Forget a worker; whether it was registered."""
        if self.workers.pop(worker_id, None) is None:
            return False
        self.deaths += 1
        return True

    def touch(self, worker_id: str) -> WorkerInfo | None:
        """Note that ``worker_id`` is alive now."""
        info = self.workers.get(worker_id)
        if info is not None:
            info.last_heartbeat = time.time()
        return info

    def silent(self, now: float, timeout: float) -> list[str]:
        """The workers not heard from for more than ``timeout`` seconds."""
        return [w for w, i in self.workers.items() if now - i.last_heartbeat > timeout]

    def refused(self, worker_id: str) -> int:
        """Count one more refused contribution of ``worker_id``; the count in a row."""
        count = self.refusals[worker_id] = self.refusals.get(worker_id, 0) + 1
        return count

    def sync_every(self, worker_id: str, base: int) -> int | None:
        """DyLU: ``base`` scaled by this worker's speed over the fastest's (None: no speed)."""
        speeds = {w: i.steps_per_second for w, i in self.workers.items() if i.steps_per_second > 0}
        if worker_id not in speeds:
            return None
        return max(1, int(speeds[worker_id] / max(speeds.values()) * base))

    def describe(self) -> dict[str, dict[str, Any]]:
        """The ``workers`` of ``/status`` (never a secret or an address)."""
        return {
            w: {
                "hostname": i.hostname,
                "registered_at": i.registered_at,
                "last_heartbeat": i.last_heartbeat,
                "sync_round": i.sync_round,
                "last_sync_server_round": i.last_sync_server_round,
                "steps_per_second": i.steps_per_second,
            }
            for w, i in self.workers.items()
        }
