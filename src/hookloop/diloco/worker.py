"""One DiLoCo worker's side: when to sync which fragment, and what to send.

The worker counts its local optimizer steps within a period of H steps.
With ``num_fragments`` F, fragment *k* is due at step ``(k + 1) * H // F`` of
the period: the F fragments are spread evenly over it, in order, so a worker
sends 1/F of the parameters F times per period instead of everything at once
(streaming DiLoCo). With F = 1 everything syncs every H steps and the worker
waits for the round. With F > 1 a fragment's sync runs in the background
while training goes on, and its answer is adopted when the next fragment is
due (at most one in flight), keeping what the worker learned meanwhile: the
fragment becomes ``global + (local now - local when sent)``. Every worker
goes through the fragments in the same order (a joining worker starts at the
fragment the others sync next), so no two workers ever wait on each other in
different fragments' rounds. A sync sends ``base - local`` for the fragment (``base``: the global
weights this worker last received for it), waits for the round to close, and
adopts the returned weights, which also become the new ``base``.

DyLU: each worker reports its local speed (steps per second, sync time
excluded); the server answers with the fastest live worker's speed, and a
worker with ``dylu`` sets ``H = round(sync_every * own / fastest)`` (at least
F, at most ``sync_every``), so slower workers take fewer local steps and all
reach the round at about the same time.

Under ``torchrun`` (data parallel inside one worker) only rank 0 talks to the
server; the new weights and the period are broadcast to the other ranks.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hookloop.diloco.client import DiLoCoClient, ServerUnavailable, with_retries

log = logging.getLogger("hookloop.diloco")

#: The counters a checkpoint keeps (seed 004's names).
COUNTERS = (
    "sync_count",
    "local_step",
    "total_sync_time",
    "sync_retries",
    "reconnections",
    "dylu_adjustments",
    "fragment_syncs",
)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def fragment_offset(k: int, period: int, num_fragments: int) -> int:
    """The step of the period (1 to ``period``) at which fragment ``k`` syncs."""
    return (k + 1) * period // num_fragments


def next_fragment(rounds: list[int]) -> int:
    """The fragment the workers sync next, from the server's rounds (fragment 0 runs ahead)."""
    return next((k for k, r in enumerate(rounds) if r != rounds[0]), 0)


def dylu_period(base: int, own: float | None, fastest: float | None, floor: int) -> int:
    """Local steps for a worker running at ``own`` steps/s when the fastest runs ``fastest``."""
    if not own or not fastest:
        return base
    return max(floor, min(base, round(base * own / fastest)))


@dataclass
class _Pending:
    """One fragment's sync: sent, possibly still on its way back."""

    k: int
    started: float
    sent: dict[str, torch.Tensor] = field(default_factory=dict)
    answer: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    blocked: float = 0.0


class DiLoCoWorker:
    """Drives one worker: join, sync fragments when due, heartbeats, leave."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        server_addr: str,
        sync_every: int,
        worker_id: str,
        bf16_comm: bool,
        dylu: bool,
        heartbeat_interval: float,
        num_fragments: int,
        timeout: float,
        max_sync_retries: int,
        token: str | None = None,
        cafile: str | None = None,
    ) -> None:
        self.model = model
        self.server_addr = server_addr
        self.base_sync_every = sync_every
        self.sync_every = sync_every
        self.worker_id = worker_id
        self.bf16_comm = bf16_comm
        self.dylu = dylu
        self.heartbeat_interval = heartbeat_interval
        self.num_fragments = num_fragments
        self.timeout = timeout
        self.max_sync_retries = max_sync_retries
        self.distributed = dist.is_available() and dist.is_initialized()
        self.talks = not self.distributed or dist.get_rank() == 0  # rank 0 talks to the server
        self.client = (
            DiLoCoClient(server_addr, token=token, timeout=timeout, cafile=cafile)
            if self.talks
            else None
        )
        self._beat_client = (
            DiLoCoClient(server_addr, token=token, timeout=timeout, cafile=cafile)
            if self.talks
            else None
        )
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.base: dict[str, torch.Tensor] = {}
        self.fragments: list[list[str]] = []
        self.rounds: list[int] = []
        self.sync_count = 0
        self.local_step = 0
        self.cycle_step = 0  # local steps into the current period
        self.next_fragment = 0
        self.total_sync_time = 0.0
        self.sync_retries = 0
        self.reconnections = 0
        self.dylu_adjustments = 0
        self.fragment_syncs = 0
        self.stale_syncs = 0
        self.last_sync_time = 0.0
        self.steps_per_sec: float | None = None
        self.fastest: float | None = None
        self._period_start = (time.monotonic(), 0)
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        self._in_flight: _Pending | None = None
        self._in_flight_overlaps = num_fragments > 1  # training went on while it was away

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        """Join the server and start from its global weights."""
        meta: dict[str, Any] = {}
        if self.talks:
            assert self.client is not None
            weights = {n: p.detach() for n, p in self.params.items()}
            join_meta = {
                "worker_id": self.worker_id,
                "num_fragments": self.num_fragments,
                "heartbeat_interval": self.heartbeat_interval,
                "names": list(self.params),  # model order, which fragments follow
            }
            tensors, meta = self._retrying(lambda: self.client.join(weights, join_meta))
            self._adopt(tensors)
            self._beats = threading.Thread(
                target=self._beat, name="hookloop-diloco-heartbeat", daemon=True
            )
            self._beats.start()
        meta = self._share(meta, list(self.params))
        self.fragments, self.rounds = meta["fragments"], list(meta["rounds"])
        self.next_fragment = next_fragment(self.rounds)  # join the cycle where the others are
        self.cycle_step = (
            0
            if self.next_fragment == 0
            else fragment_offset(self.next_fragment - 1, self.sync_every, self.num_fragments)
        )
        self.fastest = meta.get("fastest_steps_per_sec")
        self._period_start = (time.monotonic(), self.local_step)

    def stop(self) -> None:
        """Adopt the fragment still in flight, stop the heartbeats, tell the server we left."""
        try:
            self.finish_in_flight()
        except Exception as err:  # leaving anyway: the server drops us if this fails too
            log.warning("diloco: the last fragment's sync failed: %s", err)
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=5.0)
            self._beats = None
        if self.talks and self.client is not None:
            try:
                self.client.leave(self.worker_id)
            except Exception as err:  # the server may be gone already: it will drop us
                log.warning("diloco: could not tell the server %s left: %s", self.worker_id, err)

    def after_step(self) -> None:
        """Count one local step and sync the fragments now due."""
        self.local_step += 1
        self.cycle_step += 1
        k = self.next_fragment
        while k < self.num_fragments and self.cycle_step >= fragment_offset(
            k, self.sync_every, self.num_fragments
        ):
            if self.num_fragments == 1:
                self.sync(k)
            else:  # streaming: the previous fragment's answer first, then send this one
                self.finish_in_flight()
                self._in_flight = self._send(k, background=True)
            k = self.next_fragment = (k + 1) % self.num_fragments
            if k == 0:  # the period is over (its length may have changed: DyLU)
                self.cycle_step = 0
                break

    # -- one sync -------------------------------------------------------------------
    def sync(self, k: int) -> None:
        """Send fragment ``k``'s pseudo-gradient and adopt the round's answer (blocking)."""
        self._complete(self._send(k, background=False))

    def finish_in_flight(self) -> None:
        """Wait for the fragment still in flight (streaming) and adopt its answer."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            self._complete(pending)

    def _send(self, k: int, *, background: bool) -> _Pending:
        started = time.monotonic()
        pending = _Pending(k, started)
        if not self.talks:
            return pending
        assert self.client is not None
        client = self.client
        self._measure_speed(started)
        names = self.fragments[k]
        with torch.no_grad():
            pending.sent = {n: self.params[n].detach().float().clone() for n in names}
            grads = {n: self.base[n] - pending.sent[n] for n in names}
        send_meta = {
            "worker_id": self.worker_id,
            "fragment": k,
            "round": self.rounds[k],
            "steps_per_sec": self.steps_per_sec,
            "local_step": self.local_step,
        }

        def call() -> None:
            try:
                pending.answer = self._retrying(
                    lambda: client.sync(grads, send_meta, bf16=self.bf16_comm)
                )
            except BaseException as err:  # raised again where the answer is needed
                pending.error = err

        if background:
            pending.thread = threading.Thread(target=call, name="hookloop-diloco-sync", daemon=True)
            pending.thread.start()
        else:
            call()
        pending.blocked = time.monotonic() - started
        return pending

    def _complete(self, pending: _Pending) -> None:
        started = time.monotonic()
        k, names = pending.k, self.fragments[pending.k]
        meta: dict[str, Any] = {}
        if self.talks:
            if pending.thread is not None:
                pending.thread.join()
            if pending.error is not None:
                raise pending.error
            assert pending.answer is not None
            tensors, meta = pending.answer
            if meta.get("stale"):
                self.stale_syncs += 1
                log.warning(
                    "diloco: fragment %d round %d closed without %s; continuing from round %d",
                    k,
                    self.rounds[k],
                    self.worker_id,
                    meta["round"],
                )
            self._adopt(tensors, since=pending.sent)
            meta["period"] = self._next_period(k, meta)
        meta = self._share(meta, names)
        self.rounds[k] = meta["round"]
        if meta["period"] != self.sync_every:
            self.dylu_adjustments += 1
            self.sync_every = meta["period"]
        self.fragment_syncs += 1
        if k == self.num_fragments - 1:
            self.sync_count += 1
        self.last_sync_time = pending.blocked + time.monotonic() - started  # time not training
        self.total_sync_time += self.last_sync_time
        self._period_start = (time.monotonic(), self.local_step)

    def _measure_speed(self, now: float) -> None:
        since, step = self._period_start
        if self.local_step > step and now > since:
            self.steps_per_sec = (self.local_step - step) / (now - since)

    def _next_period(self, k: int, meta: dict[str, Any]) -> int:
        if not self.dylu or k != self.num_fragments - 1:  # the period ends with the last fragment
            return self.sync_every
        fastest = meta.get("fastest_steps_per_sec") or self.fastest
        return dylu_period(self.base_sync_every, self.steps_per_sec, fastest, self.num_fragments)

    @torch.no_grad()
    def _adopt(
        self, tensors: dict[str, torch.Tensor], since: dict[str, torch.Tensor] | None = None
    ) -> None:
        """The server's weights become this worker's new base and its weights, plus what
        it learned since it sent them (``since``: its weights then; streaming only)."""
        for name, value in tensors.items():
            param = self.params[name]
            base = value.to(device=param.device, dtype=torch.float32)
            self.base[name] = base
            if since is not None and self._in_flight_overlaps:
                base = base + (param.detach().float() - since[name])
            param.copy_(base.to(param.dtype))

    def _share(self, meta: dict[str, Any], names: list[str]) -> dict[str, Any]:
        """Rank 0's answer and weights on every rank of this worker's own job."""
        if not self.distributed or dist.get_world_size() < 2:
            return meta
        box = [meta]
        dist.broadcast_object_list(box, src=0)
        for name in names:
            dist.broadcast(self.params[name].data, src=0)
        return box[0]

    def _retrying(self, call: Any) -> Any:
        failed = [False]

        def note(attempt: int, err: Exception) -> None:
            failed[0] = True
            self.sync_retries += 1
            log.warning("diloco: %s; retry %d of %d", err, attempt, self.max_sync_retries)

        result = with_retries(call, self.max_sync_retries, on_retry=note)
        if failed[0]:
            self.reconnections += 1
        return result

    def _beat(self) -> None:
        assert self._beat_client is not None
        while not self._stop.wait(self.heartbeat_interval):
            try:
                answer = self._beat_client.heartbeat(self.worker_id, self.steps_per_sec)
                self.fastest = answer.get("fastest_steps_per_sec") or self.fastest
            except (ServerUnavailable, ValueError) as err:  # the next sync retries for real
                log.debug("diloco: heartbeat failed: %s", err)
            except Exception as err:
                log.warning("diloco: heartbeat failed: %s", err)

    # -- reporting and checkpoints --------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return 0 if self.client is None else self.client.bytes_sent

    @property
    def bytes_received(self) -> int:
        return 0 if self.client is None else self.client.bytes_received

    @property
    def sync_metrics(self) -> dict[str, float]:
        return {
            "diloco/sync_count": self.sync_count,
            "diloco/fragment_syncs": self.fragment_syncs,
            "diloco/sync_every": self.sync_every,
            "diloco/last_sync_time": self.last_sync_time,
            "diloco/total_sync_time": self.total_sync_time,
            "diloco/sync_retries": self.sync_retries,
            "diloco/reconnections": self.reconnections,
            "diloco/dylu_adjustments": self.dylu_adjustments,
            "diloco/stale_syncs": self.stale_syncs,
            "diloco/bytes_sent": self.bytes_sent,
            "diloco/bytes_received": self.bytes_received,
        }

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {c: getattr(self, c) for c in COUNTERS}
        state.update(sync_every=self.sync_every, worker_id=self.worker_id)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for c in COUNTERS:
            if c in state:
                setattr(self, c, type(getattr(self, c))(state[c]))
        if "sync_every" in state:
            self.sync_every = int(state["sync_every"])
