"""One DiLoCo worker: Forgather's ``DiLoCoWorker`` rules, driven by hookloop's loop.

After every optimizer step (:meth:`DiLoCoWorker.after_step`) the worker counts
a local step. With one fragment it syncs when ``sync_every`` steps are done:
it sends ``global - local`` (the pseudo-gradient, bfloat16 with
``bf16_comm``), waits for the server's new global weights, loads them and
starts counting again. With ``num_fragments`` F > 1 (streaming) the
parameters are cut into F contiguous groups; fragment k is sent at every
multiple of ``sync_every // F`` steps in turn, from a background thread, and
its answer is loaded just before the next fragment is sent (at most one in
flight). A sync that cannot reach the server is retried after registering
again (``max_sync_retries`` times, 2 s, 4 s, ... apart); when all fail the
round is skipped and training goes on, as Forgather's worker does, but only
``max_missed_syncs`` times in a row (default 3; 0: no bound, as Forgather): then the
worker raises :class:`ServerLost`, one line naming the server and the last failure,
rather than train on alone and end as if it had synced. A server that no longer
knows the worker (answered 404: restarted, or it dropped a
silent worker) is joined again the same way. The worker secret that
registering brings (:mod:`hookloop.diloco.membership`) goes with every later
request, heartbeats included. An answer must hold every parameter it was asked
for (the whole model at registration and full syncs, the fragment's at a fragment
sync); one that holds none, or lacks some, is a ``ValueError`` naming them (the
server runs another model).

A sync the server answers "paused" (its outer loop is paused, :mod:`hookloop.diloco.pause`)
is neither retried nor missed: the worker keeps its weights and its copy of the global
weights, trains on, and syncs again at its next sync point, so that pseudo-gradient
covers every local step since the weights it last got (``diloco/paused_syncs`` counts
such syncs).

Heartbeats (every ``heartbeat_interval`` seconds; 0 disables them) report the
worker's steps per second; with ``dylu`` the server's ``recommended_sync_every``
replaces ``sync_every``. Under ``torchrun`` only rank 0 talks to the server;
new weights and DyLU changes reach the other ranks by broadcast at the sync.
"""

from __future__ import annotations

import collections
import logging
import platform
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from hookloop.diloco.client import DiLoCoClient, ServerPaused, ServerRefused
from hookloop.diloco.wire import fragment_due, split_fragments

log = logging.getLogger("hookloop.diloco")

#: The counters a checkpoint keeps (Forgather's ``DiLoCoCallback`` keys).
COUNTERS = (
    "sync_count",
    "local_step",
    "total_sync_time",
    "sync_retries",
    "reconnections",
    "dylu_adjustments",
    "fragment_syncs",
)
#: The server's answer to a request under an id it does not know (it restarted, or dropped
#: the worker as silent): the worker registers again.
NOT_REGISTERED = 404
#: The longest heartbeat interval accepted, in seconds (0 disables heartbeats).
MAX_HEARTBEAT_INTERVAL = 3600.0
#: Syncs in a row that may fail to reach the server before the worker stops.
MAX_MISSED_SYNCS = 3
#: Names listed in full in an error message; the rest are counted.
_SHOWN = 5


class ServerLost(ConnectionError):
    """The server could not be reached for ``max_missed_syncs`` syncs in a row."""


def default_worker_id() -> str:
    """``worker_<host>_<8 hex>``, as Forgather names its workers."""
    return f"worker_{platform.node()}_{uuid.uuid4().hex[:8]}"


def check_heartbeat_interval(value: Any) -> float:
    """0 (no heartbeats) or seconds in (0, 3600]."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not 0 <= value <= MAX_HEARTBEAT_INTERVAL or value != value:
        raise ValueError(
            f"heartbeat_interval must be 0 (no heartbeats) or seconds in (0, "
            f"{MAX_HEARTBEAT_INTERVAL:g}], got {value!r}"
        )
    return float(value)


class DiLoCoWorker:
    """Registers, syncs when due, sends heartbeats and deregisters; see the module text."""

    def __init__(
        self,
        model: torch.nn.Module,
        server_addr: str,
        sync_every: int = 500,
        worker_id: str | None = None,
        bf16_comm: bool = True,
        timeout: float = 600,
        dylu: bool = False,
        heartbeat_interval: float = 30.0,
        num_fragments: int = 1,
        max_sync_retries: int = 3,
        *,
        token: str | None = None,
        cafile: str | None = None,
        retry_delay: float = 2.0,
        max_missed_syncs: int = MAX_MISSED_SYNCS,
    ) -> None:
        self.model = model
        self.sync_every = sync_every
        self.initial_sync_every = sync_every
        self.worker_id = worker_id or default_worker_id()
        self.bf16_comm = bf16_comm
        self.dylu = dylu
        self.heartbeat_interval = check_heartbeat_interval(heartbeat_interval)
        self.num_fragments = num_fragments
        self.max_sync_retries = max_sync_retries
        self.retry_delay = retry_delay
        self.max_missed_syncs = max_missed_syncs
        self.missed_syncs = 0  # in a row
        self.paused_syncs = 0  # answered "paused" (not missed: the server was reached)
        self._server_paused = False  # the last sync was answered "paused" (every rank)
        self._last_failure = "no answer"
        self.distributed = dist.is_available() and dist.is_initialized()
        self.talks = not self.distributed or dist.get_rank() == 0
        # An answer is at most the model in float64 plus 64 MiB (the server's own body cap).
        answer_cap = sum(p.numel() for p in model.parameters()) * 8 + 64 * 2**20
        self.client = DiLoCoClient(
            server_addr, timeout, retry_delay=retry_delay / 2, token=token, cafile=cafile,
            max_answer_bytes=answer_cap,
        )  # fmt: skip
        self._beat_client = DiLoCoClient(server_addr, min(timeout, 30), token=token, cafile=cafile)
        self._beat_client.secrets = self.client.secrets  # one secret per id, both clients
        self.params = dict(model.named_parameters())
        self.fragments = split_fragments(list(self.params), num_fragments)
        self.global_params: dict[str, torch.Tensor] = {}
        self.sync_count = self.local_step = 0
        self.total_sync_time = self.last_sync_time = 0.0
        self.sync_retries = self.reconnections = self.dylu_adjustments = self.fragment_syncs = 0
        self.last_send_bytes = self.last_recv_bytes = 0
        self._steps: collections.deque[float] = collections.deque(maxlen=100_000)
        self._recommended: int | None = None
        self._beat_stop = threading.Event()
        self._beats: threading.Thread | None = None
        self._in_flight: tuple[int, threading.Thread, list[Any]] | None = None
        self.active = False

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Register, load the global weights, start the heartbeats."""
        if self.talks:
            self._load(self.client.register(self.worker_id, self._info()), list(self.params))
        self._server_paused = False
        self._share(list(self.params), ok=True)
        self.local_step = 0
        self.active = True
        if self.talks and self.heartbeat_interval > 0:
            self._beat_stop.clear()
            self._beats = threading.Thread(
                target=self._beat, name="hookloop-diloco-beat", daemon=True
            )
            self._beats.start()

    def stop(self) -> None:
        """Load the fragment still in flight, stop the heartbeats, deregister."""
        if not self.active:
            return
        self._finish_in_flight(raise_refusal=False)
        self._beat_stop.set()
        if self._beats is not None:
            self._beats.join(timeout=5)
            self._beats = None
        if self.talks:
            try:
                self.client.deregister(self.worker_id)
            except Exception as err:  # the server drops silent workers anyway
                log.warning("diloco: could not deregister %s: %s", self.worker_id, err)
        self.active = False

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "hostname": platform.node(),
            "sync_every": self.sync_every,
            "bf16_comm": self.bf16_comm,
            "dylu": self.dylu,
        }
        if torch.cuda.is_available():
            info["num_gpus"] = torch.cuda.device_count()
        return info

    # -- the schedule -----------------------------------------------------------------------
    def after_step(self) -> None:
        """Count one local step; sync (or send a fragment) when one is due."""
        self.local_step += 1
        self._steps.append(time.time())
        if self.num_fragments == 1:
            if self.local_step >= self.sync_every:
                self.force_sync()
            return
        due = fragment_due(self.local_step, self.sync_every, self.num_fragments)
        if due is not None:
            self._finish_in_flight()
            self._send_fragment(due)
        if self.local_step >= self.sync_every:
            self.local_step = 0
            self.sync_count += 1
            self._steps.clear()

    def force_sync(self) -> None:
        """A full-model sync now (after the fragment in flight, if any)."""
        self._finish_in_flight()
        started = time.time()
        new: dict[str, torch.Tensor] | None = None
        self._server_paused = False
        if self.talks:
            new = self._submit_with_retries()
        synced = self._share(list(self.params), ok=new is not None or not self.talks, new=new)
        if synced:
            self.last_sync_time = time.time() - started
            self.total_sync_time += self.last_sync_time
        self.local_step = 0
        self.sync_count += 1
        self._steps.clear()
        self._count_missed(synced or self._server_paused)

    def _count_missed(self, synced: bool) -> None:
        """Count a sync that did not reach the server (on every rank alike: ``synced`` is
        rank 0's, shared); raise :class:`ServerLost` once ``max_missed_syncs`` are in a row."""
        self.missed_syncs = 0 if synced else self.missed_syncs + 1
        if self.max_missed_syncs and self.missed_syncs >= self.max_missed_syncs:
            raise ServerLost(
                f"DiLoCo server {self.client.server_addr} not reached for {self.missed_syncs} "
                f"syncs in a row (last: {self._last_failure}); the worker stops rather than "
                "train alone: start the server again and resume this run, or allow more "
                "with max_missed_syncs= (DILOCO_MAX_MISSED_SYNCS)"
            )

    def _submit_with_retries(self) -> dict[str, torch.Tensor] | None:
        grads = self._pseudo_grads(list(self.params))
        wait = self.retry_delay
        for attempt in range(self.max_sync_retries + 1):
            try:
                new = self.client.submit_pseudogradients(self.worker_id, grads)
                self.last_recv_bytes = _nbytes(new)
                self._check_answer(new, list(self.params))
                return new
            except ServerRefused as err:
                if err.status != NOT_REGISTERED or attempt == self.max_sync_retries:
                    raise  # the server says the request is wrong: retrying cannot help
                self.sync_retries += 1
                log.warning("diloco: %s; registering again", err)
                self._reconnect()
                grads = self._pseudo_grads(list(self.params))
            except ServerPaused as err:  # not a failure: train on, sync at the next point
                self._server_paused = True
                log.info("diloco: %s", err)
                return None
            except ConnectionError as err:
                self._last_failure = " ".join(str(err).split())[:300]
                if attempt == self.max_sync_retries:
                    log.error("diloco: sync failed %d times (%s); skipping this round",
                              attempt + 1, err)  # fmt: skip
                    return None
                self.sync_retries += 1
                log.warning("diloco: sync failed (%s); registering again in %.0f s", err, wait)
                time.sleep(wait)
                wait *= 2
                self._reconnect()
                grads = self._pseudo_grads(list(self.params))
        return None

    def _reconnect(self) -> None:
        try:
            self._load(self.client.register(self.worker_id, self._info()), list(self.params))
            self.reconnections += 1
        except Exception as err:  # the next attempt tries again
            log.warning("diloco: registering again failed: %s", err)

    def _send_fragment(self, k: int) -> None:
        result: list[Any] = [None, time.time(), None, False]  # new, started, refused, paused
        if self.talks:
            grads = self._pseudo_grads(self.fragments[k])

            def send() -> None:
                try:
                    result[0] = self._submit_fragment(k, grads)
                except ServerRefused as err:  # raised where the answer is loaded
                    result[2] = err
                except ServerPaused as err:  # the fragment waits for the next turn
                    log.info("diloco: fragment %d: %s", k, err)
                    result[3] = True
                except Exception as err:  # the fragment's round goes on without us
                    log.error("diloco: fragment %d failed: %s", k, err)
                    self._last_failure = " ".join(str(err).split())[:300]

            thread = threading.Thread(target=send, name="hookloop-diloco-fragment", daemon=True)
            thread.start()
        else:
            thread = threading.Thread(target=lambda: None)
            thread.start()
        self._in_flight = (k, thread, result)

    def _submit_fragment(self, k: int, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            return self.client.submit_fragment_pseudogradients(self.worker_id, k, grads)
        except ServerRefused as err:
            if err.status != NOT_REGISTERED:
                raise
        # Joined again without loading its weights (the other fragments are still
        # training here); this fragment goes once more, against the same start.
        log.warning("diloco: the server no longer knows %s; registering again", self.worker_id)
        self.client.register(self.worker_id, self._info())
        self.reconnections += 1
        return self.client.submit_fragment_pseudogradients(self.worker_id, k, grads)

    def finish_in_flight(self) -> None:
        """Wait for the fragment in flight, if any, and load its answer."""
        self._finish_in_flight()

    def _finish_in_flight(self, *, raise_refusal: bool = True) -> None:
        if self._in_flight is None:
            return
        k, thread, result = self._in_flight
        thread.join()
        self._in_flight = None
        new, started, refused, self._server_paused = result
        if refused is not None:
            if raise_refusal:  # as a full sync does: retrying cannot fix it
                raise refused
            log.error("diloco: fragment %d refused: %s", k, refused)
        if new is not None:
            self._check_answer(new, self.fragments[k])
        synced = self._share(self.fragments[k], ok=new is not None or not self.talks, new=new)
        if synced:
            self.fragment_syncs += 1
            self.total_sync_time += time.time() - started
            if new is not None:
                self.last_recv_bytes = _nbytes(new)
        if raise_refusal:  # not while leaving (train end, or an exception already raised)
            self._count_missed(synced or self._server_paused)

    # -- tensors ----------------------------------------------------------------------------
    @torch.no_grad()
    def _pseudo_grads(self, names: list[str]) -> dict[str, torch.Tensor]:
        grads = {}
        for name in names:
            grad = self.global_params[name] - self.params[name].detach().float().cpu()
            grads[name] = grad.to(torch.bfloat16) if self.bf16_comm else grad
        self.last_send_bytes = _nbytes(grads)
        return grads

    def _check_answer(self, new: dict[str, torch.Tensor], names: list[str]) -> None:
        """Refuse an answer that lacks any of ``names`` (the parameters asked for)."""
        missing = [n for n in names if n not in new]
        if not missing:
            return
        server = self.client.server_addr
        if not new:
            raise ValueError(
                f"DiLoCo server {server} sent no tensors where this worker needs the global "
                f"weights of {len(names)} parameters: it runs no model, or not this one"
            )
        shown = ", ".join(missing[:_SHOWN]) + (" ..." if len(missing) > _SHOWN else "")
        raise ValueError(
            f"DiLoCo server {server} lacks {len(missing)} of this model's parameters "
            f"({shown}): the server runs another model"
        )

    @torch.no_grad()
    def _load(self, new: dict[str, torch.Tensor], names: list[str]) -> None:
        """Load the server's weights for ``names`` (every one must be there)."""
        self._check_answer(new, names)
        for name, value in new.items():
            param = self.params.get(name)
            if param is None:
                log.warning("diloco: the server sent %s, which this model lacks", name)
                continue
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"the server's {name} has shape {tuple(value.shape)}, this model's "
                    f"{tuple(param.shape)}: the server runs another model"
                )
            param.copy_(value.to(dtype=param.dtype, device=param.device))
            self.global_params[name] = param.detach().float().cpu().clone()

    def _share(
        self, names: list[str], *, ok: bool, new: dict[str, torch.Tensor] | None = None
    ) -> bool:
        """Load ``new`` (rank 0's answer) on every rank; True when there was one. Rank 0's
        ``_server_paused`` reaches every rank with it (a paused sync is counted there)."""
        if self.talks and new is not None:
            self._load(new, names)
        if self.talks and self._recommended is not None and self.distributed:
            self._apply_recommendation(self._recommended)
        if not self.distributed or dist.get_world_size() < 2:
            self.paused_syncs += self._server_paused
            return ok
        box = [ok, self.sync_every, self._server_paused]
        dist.broadcast_object_list(box, src=0)
        ok, sync_every, self._server_paused = box
        self.paused_syncs += self._server_paused
        if sync_every != self.sync_every:
            self.sync_every, self.dylu_adjustments = sync_every, self.dylu_adjustments + 1
        if ok:
            with torch.no_grad():
                for name in names:
                    dist.broadcast(self.params[name].data, src=0)
                    self.global_params[name] = self.params[name].detach().float().cpu().clone()
        return ok

    # -- heartbeats and DyLU -----------------------------------------------------------------
    def _beat(self) -> None:
        while not self._beat_stop.wait(self.heartbeat_interval):
            try:
                answer = self._beat_client.heartbeat(self.worker_id, self.get_steps_per_second())
            except Exception as err:  # the next sync retries for real
                log.warning("diloco: heartbeat failed: %s", err)
                continue
            recommended = answer.get("recommended_sync_every")
            if self.dylu and isinstance(recommended, int) and recommended >= 1:
                if self.distributed:  # every rank switches at the next sync
                    self._recommended = recommended
                else:
                    self._apply_recommendation(recommended)

    def _apply_recommendation(self, recommended: int) -> None:
        self._recommended = None
        if recommended != self.sync_every:
            log.info("diloco: DyLU sync_every %d -> %d", self.sync_every, recommended)
            self.sync_every = recommended
            self.dylu_adjustments += 1

    def get_steps_per_second(self) -> float:
        """Local steps per second since the last sync (0.0 before two steps)."""
        steps = list(self._steps)
        if len(steps) < 2 or steps[-1] <= steps[0]:
            return 0.0
        return (len(steps) - 1) / (steps[-1] - steps[0])

    # -- reporting and checkpoints -------------------------------------------------------------
    @property
    def sync_metrics(self) -> dict[str, float]:
        """Forgather's ``diloco/...`` log keys."""
        metrics: dict[str, float] = {
            "diloco/sync_count": self.sync_count,
            "diloco/local_step": self.local_step,
            "diloco/last_sync_time": self.last_sync_time,
            "diloco/total_sync_time": self.total_sync_time,
            "diloco/last_send_mb": self.last_send_bytes / 1e6,
            "diloco/last_recv_mb": self.last_recv_bytes / 1e6,
            "diloco/steps_per_second": self.get_steps_per_second(),
            "diloco/sync_every": self.sync_every,
        }
        if self.dylu:
            metrics["diloco/dylu_adjustments"] = self.dylu_adjustments
        if self.num_fragments > 1:
            metrics["diloco/num_fragments"] = self.num_fragments
            metrics["diloco/fragment_syncs"] = self.fragment_syncs
        if self.sync_retries:
            metrics["diloco/sync_retries"] = self.sync_retries
        if self.paused_syncs:
            metrics["diloco/paused_syncs"] = self.paused_syncs
        if self.reconnections:
            metrics["diloco/reconnections"] = self.reconnections
        return metrics

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


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
