"""Whether the DiLoCo server takes a worker's submission.

A submission's body is unpacked (:mod:`hookloop.diloco.wire`) and its header checked
(:mod:`hookloop.control.bodies`); its sender must be a member in good standing
(:mod:`hookloop.diloco.roster`); its tensors must match the global weights and the
round's other submissions, and (unless the bound is off) move the weights by at most
``max_update_ratio`` times their norm (:mod:`hookloop.diloco.validate`).

A refused submission is answered 400 with the reason and counted against its sender,
who sits the round out so that the others' round closes; after ``max_refusals`` refusals
in a row the sender is evicted, and every later request under its id is answered 409.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hookloop.control.bodies import BodyError, check_tree
from hookloop.control.service import one_line
from hookloop.diloco import fields
from hookloop.diloco.membership import Caller
from hookloop.diloco.roster import ProtocolError, Roster
from hookloop.diloco.rounds import OuterRounds
from hookloop.diloco.validate import check_contribution, check_same_names, check_update_ratio
from hookloop.diloco.wire import unpack

log = logging.getLogger("hookloop.diloco")

#: The fragment ids a streaming submission may carry.
MAX_FRAGMENTS = 4096


class Contributions:
    """Checks submissions against ``rounds`` and counts refusals in ``roster``; ``drop``
    removes an evicted worker from the server (and releases the barriers it held up)."""

    def __init__(
        self,
        roster: Roster,
        rounds: OuterRounds,
        *,
        async_mode: bool,
        max_update_ratio: float | None,
        drop: Callable[[str], None],
    ) -> None:
        self.roster, self.rounds = roster, rounds
        self.async_mode, self.max_update_ratio = async_mode, max_update_ratio
        self.drop = drop

    def accept(
        self, body: bytes, caller: Caller | None, *, fragment: bool
    ) -> tuple[str, Any, dict[str, torch.Tensor]]:
        """``(worker id, fragment id or None, pseudo-gradients)`` of a submission taken;
        a :class:`ProtocolError` for one refused (counted by :meth:`refuse`)."""
        try:
            header, grads = unpack(body)
            check_tree(header)
        except (ValueError, RecursionError) as err:
            raise ProtocolError(f"bad submission body: {one_line(err)}") from None
        worker_id = worker_id_in(header)
        self.roster.check_not_evicted(worker_id)
        self.roster.member(worker_id, caller)
        frag = None
        if fragment:
            frag = header.get("fragment_id")
            if isinstance(frag, bool) or not isinstance(frag, int) or not 0 <= frag < MAX_FRAGMENTS:
                raise self.refuse(
                    worker_id,
                    f"fragment_id must be an int in [0, {MAX_FRAGMENTS}), got {frag!r}",
                    frag,
                )
        error = self._problem(worker_id, grads, frag)
        if error is not None:
            raise self.refuse(worker_id, error, frag)
        self.roster.refusals.pop(worker_id, None)
        self.rounds.excused.get(frag, set()).discard(worker_id)
        return worker_id, frag, grads

    def _problem(self, worker_id: str, grads: dict[str, torch.Tensor], frag: Any) -> str | None:
        """What is wrong with ``grads``, or None: their names, shapes and values, then
        their names against the fragment's other submissions, then their norm."""
        rounds = self.rounds
        error = check_contribution(worker_id, grads, rounds.view(), fragment=frag)
        others = (rounds.frag_pending.get(frag) or {}) if frag is not None else {}
        if error is None and others and not self.async_mode:
            first = next(iter(others.values()))
            error = check_same_names(worker_id, frag, set(grads), set(first))
        if error is None and self.max_update_ratio is not None:
            error = check_update_ratio(
                worker_id, grads, rounds.weights_norm(), self.max_update_ratio, fragment=frag
            )
        return error

    def refuse(self, worker_id: str, error: str, fragment: Any = None) -> ProtocolError:
        """Count a refused contribution: its sender sits this round out; evicted at the limit."""
        count = self.roster.refused(worker_id)
        limit = self.roster.max_refusals
        log.error("diloco: refused (%d/%d): %s", count, limit, error)
        registered = worker_id in self.roster.workers
        if registered and count >= limit:
            self.roster.evicted[worker_id] = error
            log.error("diloco: evicting %s after %d refused contributions", worker_id, count)
            self.drop(worker_id)
        elif not self.async_mode and registered:
            self.rounds.excuse(worker_id, fragment)  # the others' round goes on without it
        return ProtocolError(error)


def worker_id_in(data: dict[str, Any]) -> str:
    """The ``worker_id`` field of a request's JSON (or a submission's header), checked."""
    try:
        return fields.worker_id(data.get("worker_id"))
    except BodyError as err:
        raise ProtocolError(str(err)) from None
