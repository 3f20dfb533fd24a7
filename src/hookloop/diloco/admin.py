"""What an operator changes on a running DiLoCo server (``POST /control/update_optimizer``
and ``/control/update_num_workers``), each value checked (400 naming it).

A change of the outer optimizer is recorded as a live ``set`` of a training job is: a
log line and a record in ``<output_dir>/changes.jsonl``, fsynced before the change is
made; the optimizer's own state, saved with each checkpoint, carries it on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from hookloop.diloco.options import momentum, number
from hookloop.diloco.roster import ProtocolError
from hookloop.journal import Journal

log = logging.getLogger("hookloop.diloco")


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
        journal = Journal(Path(output_dir) / "changes.jsonl", fsync=True)
        journal.append(record)
        journal.close()
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
