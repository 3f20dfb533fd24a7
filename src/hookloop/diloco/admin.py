"""What an operator does to a running DiLoCo server (``POST /control/{action}``, :func:`act`):
save, kick a worker, change the outer optimizer or the count of workers expected (each
value checked, 400 naming it), pause and resume the outer loop
(:mod:`hookloop.diloco.pause`), shut down.

A change of the outer optimizer is recorded as a live ``set`` of a training job is: a
log line and a record in ``<output_dir>/changes.jsonl``, fsynced before the change is
made; the optimizer's own state, saved with each checkpoint, carries it on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from hookloop.diloco.options import momentum, number
from hookloop.diloco.pause import record_change
from hookloop.diloco.roster import ProtocolError

if TYPE_CHECKING:
    import torch

    from hookloop.diloco.pause import OuterPause
    from hookloop.diloco.roster import Roster
    from hookloop.diloco.rounds import OuterRounds

log = logging.getLogger("hookloop.diloco")

#: The actions of ``POST /control/{action}``: Forgather's, then hookloop's.
CONTROL_ACTIONS = (
    "save_state",
    "kick_worker",
    "update_optimizer",
    "update_num_workers",
    "shutdown",
    "pause",
    "resume",
)


class Operated(Protocol):
    """What the admin actions use of a :class:`~hookloop.diloco.server.DiLoCoServer`."""

    num_workers: int
    min_workers: int
    output_dir: str
    save_every_n_rounds: int
    rounds: OuterRounds
    roster: Roster
    outer_pause: OuterPause

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer: ...
    def save_state(self, path: str | None = None) -> None: ...
    def worker_left(self, worker_id: str) -> None: ...
    def request_stop(self) -> None: ...


def act(server: Operated, action: str, data: dict[str, Any]) -> dict[str, Any]:
    """Do ``action`` with the request's ``data``; its JSON answer, or :class:`ProtocolError`."""
    sync_round = server.rounds.sync_round
    if action == "save_state":
        server.save_state()
        return {"status": "ok", "sync_round": sync_round}
    if action == "kick_worker":
        worker_id = data.get("worker_id")
        if not worker_id:
            raise ProtocolError("worker_id required")
        if worker_id not in server.roster.workers:
            raise ProtocolError(f"Worker {str(worker_id)[:200]} not found", 404)
        server.worker_left(worker_id)
        return {"status": "ok", "worker_id": worker_id}
    if action == "update_optimizer":
        updated = optimizer_update(data)
        change_optimizer(server.outer_optimizer, updated, client=data.get("client"),
                         sync_round=sync_round, output_dir=server.output_dir)  # fmt: skip
        return {"status": "ok", **updated}
    if action == "update_num_workers":
        server.num_workers = worker_count(data, server.min_workers)
        return {"status": "ok", "num_workers": server.num_workers}
    if action == "shutdown":
        if server.save_every_n_rounds > 0:
            server.save_state()
        server.request_stop()
        return {"status": "ok", "message": "Shutting down"}
    if action == "pause":
        answer = server.outer_pause.pause(data.get("client"), sync_round)
        released = server.rounds.abandon_open(lambda: server.outer_pause.refusal(sync_round))
        return {**answer, "released_waiting": released}
    if action == "resume":
        return server.outer_pause.resume(data.get("client"), sync_round)
    raise ProtocolError(
        f"Unknown control action: {action[:100]}; allowed: {', '.join(CONTROL_ACTIONS)}", 404
    )


def optimizer_update(data: dict[str, Any]) -> dict[str, float]:
    """The new ``lr`` and/or ``momentum`` a request asks for."""
    updated = {}
    try:
        if "lr" in data:
            updated["lr"] = number("lr", data["lr"], low=1e-12, high=1e6)
        if "momentum" in data:
            updated["momentum"] = momentum("momentum", data["momentum"])
    except ValueError as err:
        raise ProtocolError(str(err)) from None
    if not updated:
        raise ProtocolError("No parameters to update (provide lr and/or momentum)")
    return updated


def change_optimizer(
    optimizer: torch.optim.Optimizer,
    updated: dict[str, float],
    *,
    client: Any,
    sync_round: int,
    output_dir: str,
) -> None:
    """Record the change (who asked, old and new values), then make it in every group."""
    group = optimizer.param_groups[0]
    who = client if isinstance(client, str) and client.isprintable() else "unknown"
    record = {
        "sync_round": sync_round,
        "changes": [{"key": k, "old": group.get(k), "new": v} for k, v in updated.items()],
        "client": who[:80],
        "time": time.time(),
    }
    log.info("diloco: round %d: outer optimizer %s", sync_round, record["changes"])
    if output_dir:
        record_change(output_dir, record)
    for group in optimizer.param_groups:
        group.update(updated)
    log.info("diloco: outer optimizer now %s", updated)


def worker_count(data: dict[str, Any], min_workers: int) -> int:
    """The ``num_workers`` a request sets: an int of at least ``min_workers``."""
    count = data.get("num_workers")
    if count is None:
        raise ProtocolError("num_workers required")
    if isinstance(count, bool) or not isinstance(count, int) or count < min_workers:
        raise ProtocolError(
            f"num_workers must be an int >= min_workers ({min_workers}), got {count!r}"
        )
    return count
