"""The DiLoCo server, speaking Forgather's protocol (``hookloop diloco serve``).

The server starts from a model checkpoint (:mod:`hookloop.diloco.storage`)
and holds the global weights in float32 with an outer optimizer over them
(SGD, lr 0.7, Nesterov momentum 0.9 by default). Workers register, train on
their own, and submit *pseudo-gradients* (global minus local weights).

- **Sync mode** (default): a submission waits at a barrier until every worker
  expected for the round has submitted; the mean is applied in one outer
  step and every waiter gets the new weights. The round expects the workers
  registered when it opened (its first submission); a worker that joins later
  waits for the next round; one that leaves, is kicked, or stops sending
  heartbeats for ``heartbeat_timeout`` seconds is dropped and the barrier
  re-evaluated. ``num_workers`` is, as in Forgather, the count expected (shown
  in ``/status``, raised as more register), not a barrier.
- **Async mode**: each submission is applied at once and answered with the
  current weights. With ``dn_buffer_size`` N > 0 (Delayed Nesterov) only every
  N-th submission takes a momentum step over the buffered mean; the ones in
  between take a plain ``lr * g`` step.
- **Fragments** (streaming DiLoCo): a submission may carry one fragment's
  parameters; each fragment has its own barrier, and the outer step touches
  only its parameters.
- **DyLU**: with ``dylu_enabled`` a heartbeat's answer recommends
  ``sync_every = max(1, floor(own_speed / fastest_speed * dylu_base_sync_every))``.

Every ``save_every_n_rounds`` rounds the server saves a checkpoint under
``<output_dir>/checkpoints``; started again there without ``from_checkpoint`` it
continues from the highest round, whatever format it first started from
(:mod:`~hookloop.diloco.storage`). It holds ``output_dir``'s lock while it serves, and
SIGINT/SIGTERM save the current round first (:mod:`~hookloop.diloco.lifecycle`).
Routes (Forgather's): ``POST /register``, ``/submit_pseudograd``,
``/submit_fragment_pseudograd``, ``/heartbeat``, ``/deregister``, ``/control/{save_state,
kick_worker,update_optimizer,update_num_workers,shutdown}``; ``GET /status``,
``/global_params``, ``/dashboard`` (and ``/``). hookloop adds ``/control/pause`` and
``/control/resume``: while the outer loop is paused no round advances and a submission
is answered 503 ``"paused": true``, on which workers train on locally
(:mod:`~hookloop.diloco.pause`; it outlives a restart).

hookloop's additions, which a Forgather peer does not need: a bearer
``token`` (or ``disable_auth=True`` to admit tokenless peers, loopback only
unless ``allow_remote_without_auth``), HTTPS (``certfile``/``keyfile``),
every submission checked by :func:`hookloop.diloco.validate.check_contribution`
and, unless ``max_update_ratio`` is None or 0, bounded by
:func:`~hookloop.diloco.validate.check_update_ratio`, every JSON field checked by
:mod:`hookloop.diloco.fields` (400 naming the field), a dashboard served without
the token under a strict Content-Security-Policy (:mod:`hookloop.diloco.dashboard`;
every response: :func:`hookloop.control.service.secure`), and worker ids bound to a
secret issued at ``/register`` (:mod:`hookloop.diloco.membership`): a request
under an id it does not hold is answered 403, one under an id not registered
404; neither counts against the worker nor reaches a round. Workers that send
no secret (Forgather's) are admitted only with ``allow_unbound_workers``, each
from the address it registered from.

What a faulty peer cannot do: a refused submission (another model, a wrong shape or
dtype, NaN/Inf, a value beyond :data:`~hookloop.diloco.validate.MAX_ABS_VALUE`, a norm
beyond ``max_update_ratio`` times the global weights') is
answered 400 with the reason, logged in one line, and its sender sits the round out so
the others' round closes; after ``max_refusals`` refusals in a row the sender is evicted
and every later request under its id is answered 409. An outer step that fails (or
would make a weight non-finite) leaves the weights and the optimizer as they were and
answers every waiting worker 500; a save that fails (a full disk) keeps the previous
checkpoint and is tried again after the next round. Bodies are capped at
``max_payload_mb`` (default: what the model in float64 needs, plus 64 MiB).

The parts: :mod:`~hookloop.diloco.rounds` (the weights, the outer optimizer and the
rounds' barriers), :mod:`~hookloop.diloco.roster` (the workers, their refusals and
evictions), :mod:`~hookloop.diloco.contributions` (whether a submission is taken),
:mod:`~hookloop.diloco.routes` (the HTTP face), :mod:`~hookloop.diloco.options` and
:mod:`~hookloop.diloco.admin` (arguments checked, the operator's actions),
:mod:`~hookloop.diloco.pause` (the outer loop paused), and this module,
which runs it all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hookloop.control.service import Address, Serving, bearer_matches, is_loopback, one_line
from hookloop.diloco import admin, lifecycle, options, storage
from hookloop.diloco.contributions import Contributions, worker_id_in
from hookloop.diloco.membership import Caller
from hookloop.diloco.options import MAX_HEARTBEAT_TIMEOUT, MAX_UPDATE_RATIO, integer, number
from hookloop.diloco.pause import OuterPause, clock
from hookloop.diloco.roster import ProtocolError, Roster
from hookloop.diloco.rounds import OuterRounds, RoundFailed
from hookloop.diloco.routes import CONTROL_ACTIONS, ROUTES, DiLoCoRoutes

if TYPE_CHECKING:
    import ssl

    from aiohttp import web

__all__ = [
    "CONTROL_ACTIONS",
    "MAX_HEARTBEAT_TIMEOUT",
    "MAX_REFUSALS",
    "ROUTES",
    "DiLoCoServer",
    "ProtocolError",
    "is_loopback",
]

log = logging.getLogger("hookloop.diloco")

#: Refused submissions in a row after which a worker is evicted (and answered 409 after).
MAX_REFUSALS = 3


class DiLoCoServer:
    """Forgather's ``DiLoCoServer`` (same constructor and methods) served on aiohttp.

    ``start()`` serves from a background thread, ``run()`` in the caller's
    until ``/control/shutdown`` or Ctrl-C; ``address`` and ``port`` say where
    (``port=0`` picks a free one). The keyword-only arguments are hookloop's.
    """

    _started_at: float | None  # when it began serving (None: not yet)

    def __init__(
        self,
        output_dir: str,
        num_workers: int,
        from_checkpoint: str | None = None,
        port: int | None = None,
        outer_optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
        host: str = "127.0.0.1",
        save_every_n_rounds: int = 10,
        save_total_limit: int = 3,
        async_mode: bool = False,
        safetensors: bool = True,
        dn_buffer_size: int = 0,
        dylu_enabled: bool = False,
        dylu_base_sync_every: int = 500,
        heartbeat_timeout: float = 120.0,
        min_workers: int = 1,
        dashboard_enabled: bool = True,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        token: str | None = None,
        disable_auth: bool = False,
        allow_remote_without_auth: bool = False,
        certfile: str | None = None,
        keyfile: str | None = None,
        sync_timeout: float = 600.0,
        max_payload_mb: int | None = None,
        max_refusals: int = MAX_REFUSALS,
        allow_unbound_workers: bool = False,
        max_update_ratio: float | None = MAX_UPDATE_RATIO,
    ) -> None:
        self.num_workers = integer("num_workers", num_workers, 1)
        self.min_workers = integer("min_workers", min_workers, 1)
        self.host, self.port = options.address(host, port)
        self.output_dir = str(output_dir)
        self._set_rounds(
            save_every_n_rounds, save_total_limit, async_mode=async_mode, safetensors=safetensors,
            dn_buffer_size=dn_buffer_size, dylu_enabled=dylu_enabled,
            dylu_base_sync_every=dylu_base_sync_every, heartbeat_timeout=heartbeat_timeout,
            sync_timeout=sync_timeout,
        )  # fmt: skip
        self.dashboard_enabled = bool(dashboard_enabled)
        self._set_admission(
            token, disable_auth, allow_remote_without_auth, certfile=certfile, keyfile=keyfile,
            max_refusals=max_refusals, allow_unbound_workers=allow_unbound_workers,
            max_update_ratio=max_update_ratio, max_payload_mb=max_payload_mb,
        )  # fmt: skip
        if outer_optimizer_factory is None:
            outer_optimizer_factory = options.sgd_factory(outer_lr, outer_momentum, nesterov)
        self.outer_optimizer_factory = outer_optimizer_factory
        self._running, self._started_at = False, None
        self._serving = Serving("DiLoCo")
        if from_checkpoint is not None:
            storage.check_start(self.output_dir, from_checkpoint)
        self.load_state(from_checkpoint)
        if max_payload_mb is None:  # the largest honest body: the model in float64
            max_payload_mb = math.ceil(self.rounds.model_params * 8 / 2**20) + 64
        self.max_payload_mb = max_payload_mb

    def _set_rounds(
        self,
        save_every_n_rounds: int,
        save_total_limit: int,
        *,
        async_mode: bool,
        safetensors: bool,
        dn_buffer_size: int,
        dylu_enabled: bool,
        dylu_base_sync_every: int,
        heartbeat_timeout: float,
        sync_timeout: float,
    ) -> None:
        """Check and keep how rounds run and are saved (Forgather's options, and the
        barrier's ``sync_timeout``); a bad value is a ``ValueError`` naming it."""
        self.save_every_n_rounds = integer("save_every_n_rounds", save_every_n_rounds, 0)
        self.save_total_limit = integer("save_total_limit", save_total_limit, 0)
        self.async_mode = bool(async_mode)
        self.safetensors = bool(safetensors)  # checkpoints are always safetensors here
        self.dn_buffer_size = integer("dn_buffer_size", dn_buffer_size, 0)
        self.dylu_enabled = bool(dylu_enabled)
        self.dylu_base_sync_every = integer("dylu_base_sync_every", dylu_base_sync_every, 1)
        self.heartbeat_timeout = number(
            "heartbeat_timeout", heartbeat_timeout, low=0, high=MAX_HEARTBEAT_TIMEOUT
        )
        self.sync_timeout = number("sync_timeout", sync_timeout, low=0.001)

    def _set_admission(
        self,
        token: str | None,
        disable_auth: bool,
        allow_remote_without_auth: bool,
        *,
        certfile: str | None,
        keyfile: str | None,
        max_refusals: int,
        allow_unbound_workers: bool,
        max_update_ratio: float | None,
        max_payload_mb: int | None,
    ) -> None:
        """Check and keep hookloop's own options: who may reach the server (token, TLS,
        workers without a secret) and what a contribution may be (its size, its norm,
        refusals before eviction). A bad value is a ``ValueError`` naming it."""
        if max_payload_mb is not None:
            integer("max_payload_mb", max_payload_mb, 1)
        self.max_refusals = integer("max_refusals", max_refusals, 1)
        self.allow_unbound_workers = options.flag("allow_unbound_workers", allow_unbound_workers)
        if max_update_ratio is not None:
            number("max_update_ratio", max_update_ratio, low=0)
        self.max_update_ratio = max_update_ratio or None
        storage.check_output_dir(self.output_dir)
        options.check_auth(token, disable_auth, allow_remote_without_auth)
        self.token, self.disable_auth = token, disable_auth
        self.allow_remote_without_auth = allow_remote_without_auth
        options.check_tls_files(certfile, keyfile)
        self.certfile, self.keyfile = certfile, keyfile

    # -- state ------------------------------------------------------------------------
    def _initialize(self, weights: dict[str, torch.Tensor]) -> None:
        self.rounds = OuterRounds(
            weights,
            self.outer_optimizer_factory,
            async_mode=self.async_mode,
            dn_buffer_size=self.dn_buffer_size,
            members=lambda: self.roster.workers,
            num_workers=lambda: self.num_workers,
            after_round=self._after_round,
        )
        self.roster = Roster(
            max_refusals=self.max_refusals, allow_unbound=self.allow_unbound_workers
        )
        self.contributions = Contributions(
            self.roster, self.rounds, async_mode=self.async_mode,
            max_update_ratio=self.max_update_ratio, drop=self.worker_left,
        )  # fmt: skip
        self.outer_pause = OuterPause(self.output_dir)  # paused as the journal last says

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the outer steps, over the global weights."""
        return self.rounds.optimizer

    def load_state(self, checkpoint_path: str | None = None) -> None:
        """Start from ``checkpoint_path``, or the newest checkpoint in ``output_dir``."""
        if self._running:
            raise RuntimeError("the server cannot load a checkpoint while it runs; stop it first")
        if checkpoint_path is None:
            found = storage.find_all(self.output_dir)
            if not found:
                raise ValueError(
                    f"no checkpoint in {self.output_dir} (nor under its checkpoints/): pass "
                    "from_checkpoint= a model directory (model.safetensors, pytorch_model.bin "
                    "or a sharded index)"
                )
            skipped = []
            for candidate in found:
                try:
                    self._load_from(str(candidate))
                except storage.RoundMismatch:
                    raise  # not damage: a checkpoint out of place, which an operator must move
                except ValueError as err:
                    log.warning("diloco: skipping damaged checkpoint %s: %s", candidate, err)
                    skipped.append(f"{candidate.name} ({err})")
                    continue
                return
            raise ValueError(
                f"no intact checkpoint in {self.output_dir}: {'; '.join(skipped)}"[:1000]
            )
        self._load_from(checkpoint_path)

    def _load_from(self, checkpoint_path: str) -> None:
        weights = storage.load_weights(checkpoint_path)
        state = storage.load_server_state(checkpoint_path)
        if state is not None:
            storage.check_round(checkpoint_path, state)
            weights = storage.in_saved_order(weights, state, checkpoint_path)
        self._initialize(weights)
        if state is None:
            log.info("diloco: global weights from %s (no server state: round 0)", checkpoint_path)
            return
        self.rounds.load(state, checkpoint_path)
        log.info("diloco: continuing from %s at round %d", checkpoint_path,
                 self.rounds.sync_round)  # fmt: skip

    def save_state(self, path: str | None = None) -> None:
        """Save weights and server state (skipped when nothing changed since the last save)."""
        if not self._running:
            raise RuntimeError("the server is not running")
        if not self.rounds.dirty:
            log.info("diloco: nothing changed since the last save; not saving")
            return
        target = Path(path) if path is not None else (
            Path(self.output_dir) / "checkpoints" / f"checkpoint-{self.rounds.sync_round}"
        )  # fmt: skip
        storage.save(target, self.get_global_params(), self._server_state())
        log.info("diloco: saved %s", target)
        if path is None:
            storage.rotate(self.output_dir, self.save_total_limit)
        self.rounds.dirty = False

    def _server_state(self) -> dict[str, Any]:
        state = self.rounds.state()
        return {
            "outer_optimizer": state["outer_optimizer"],
            "sync_round": state["sync_round"],
            "num_workers": self.num_workers,
            "param_names": state["param_names"],
            "async_mode": self.async_mode,
            "total_submissions": state["total_submissions"],
        }

    def _after_round(self) -> None:
        if self.save_every_n_rounds > 0 and self.rounds.sync_round % self.save_every_n_rounds == 0:
            try:
                self.save_state()
            except Exception as err:  # a failed save must not fail the round
                log.error(
                    "diloco: saving round %d failed (%s); the previous checkpoint is kept and "
                    "the next round tries again", self.rounds.sync_round, one_line(err)
                )  # fmt: skip

    def get_global_params(self) -> dict[str, torch.Tensor]:
        """A copy of the global weights (float32)."""
        return self.rounds.global_params()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- membership -----------------------------------------------------------------------
    def register(
        self, info: dict[str, Any], caller: Caller | None = None
    ) -> dict[str, torch.Tensor]:
        """Admit (or admit again) a worker; its secret is then ``secret_of(worker_id)``."""
        worker_id = worker_id_in(info)
        self.roster.admit(worker_id, info, caller or Caller())
        workers = self.roster.workers
        self.num_workers = max(self.num_workers, len(workers))
        log.info("diloco: worker %s registered (%d/%d)", worker_id, len(workers), self.num_workers)
        return self.get_global_params()

    def secret_of(self, worker_id: str) -> str:
        """The secret ``/register`` issued to ``worker_id`` (its reply's X-Worker-Secret)."""
        return self.roster.workers[worker_id].secret

    def deregister(self, worker_id: str, caller: Caller | None = None) -> None:
        """A worker leaves; an id not registered is a no-op (as Forgather answers it)."""
        if worker_id in self.roster.workers:
            self.roster.member(worker_id, caller)
            self.worker_left(worker_id)

    def worker_left(self, worker_id: str) -> None:
        """Drop a worker (left, kicked or silent) and release the barriers it held up."""
        if not self.roster.remove(worker_id):
            return
        remaining = len(self.roster.workers)
        self.num_workers = max(self.min_workers, remaining)
        log.warning("diloco: worker %s gone; %d remain", worker_id, remaining)
        self.rounds.drop(worker_id)

    def evict_silent(self, now: float | None = None) -> list[str]:
        """Drop the workers whose last heartbeat is older than ``heartbeat_timeout``."""
        if self.heartbeat_timeout <= 0:
            return []
        silent = self.roster.silent(time.time() if now is None else now, self.heartbeat_timeout)
        for worker_id in silent:
            log.warning(
                "diloco: no heartbeat from %s for %.1f s", worker_id, self.heartbeat_timeout
            )
            self.worker_left(worker_id)
        return silent

    def recommended_sync_every(self, worker_id: str) -> int | None:
        """DyLU's ``sync_every`` for ``worker_id``, or None (disabled, no speeds yet)."""
        if not self.dylu_enabled:
            return None
        return self.roster.sync_every(worker_id, self.dylu_base_sync_every)

    # -- contributions --------------------------------------------------------------------
    async def submit(self, body: bytes, caller: Caller | None = None) -> dict[str, torch.Tensor]:
        worker_id, _, grads = self.contributions.accept(body, caller, fragment=False)
        info = self.roster.touch(worker_id)
        self.outer_pause.check(self.rounds.sync_round)
        if info is not None:
            info.sync_round += 1
            info.last_sync_server_round = self.rounds.sync_round + 1
        if self.async_mode:
            try:
                self.rounds.apply_async(grads)
            except RuntimeError as err:
                log.error("diloco: %s", one_line(err))
                raise ProtocolError(f"DiLoCo server error: {one_line(err)}", 500) from None
            return self.get_global_params()
        return await self._wait(self.rounds.enter(worker_id, grads), "Sync timeout")

    async def submit_fragment(
        self, body: bytes, caller: Caller | None = None
    ) -> dict[str, torch.Tensor]:
        worker_id, frag, grads = self.contributions.accept(body, caller, fragment=True)
        self.roster.touch(worker_id)
        self.outer_pause.check(self.rounds.sync_round)
        if self.async_mode:
            try:
                return self.rounds.apply_async_fragment(grads)
            except RuntimeError as err:
                log.error("diloco: %s", one_line(err))
                raise ProtocolError(f"DiLoCo server error: {one_line(err)}", 500) from None
        done = self.rounds.enter_fragment(worker_id, frag, grads)
        return await self._wait(done, "Fragment sync timeout")

    async def _wait(self, done: asyncio.Future[Any], message: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.sync_timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(message, 504) from None
        except RoundFailed as err:
            raise ProtocolError(f"DiLoCo server error: {err}", 500) from None

    def heartbeat(self, data: dict[str, Any], caller: Caller | None = None) -> dict[str, Any]:
        worker_id = worker_id_in(data)
        self.roster.check_not_evicted(worker_id)
        self.roster.member(worker_id, caller)
        info = self.roster.touch(worker_id)
        speed = data.get("steps_per_second")
        if info is not None and speed is not None:
            info.steps_per_second = number("steps_per_second", speed, low=0, high=1e9)
        answer: dict[str, Any] = {
            "status": "ok",
            "sync_round": self.rounds.sync_round,
            "num_workers": self.num_workers,
            "num_registered": len(self.roster.workers),
            "paused": self.outer_pause.paused,
        }
        recommended = self.recommended_sync_every(worker_id)
        if recommended is not None:
            answer["recommended_sync_every"] = recommended
        return answer

    def status(self) -> dict[str, Any]:
        """Forgather's ``/status`` reply, key for key."""
        group = self.outer_optimizer.param_groups[0]
        reply: dict[str, Any] = {
            "status": "running",
            "mode": "async" if self.async_mode else "sync",
            "sync_round": self.rounds.sync_round,
            "num_workers": self.num_workers,
            "num_registered": len(self.roster.workers),
            "workers": self.roster.describe(),
            "pending_submissions": [] if self.async_mode else list(self.rounds.pending),
            "started_at": self._started_at,
            "uptime_seconds": time.time() - self._started_at if self._started_at else 0,
        }
        if self.async_mode:
            reply.update(
                total_submissions=self.rounds.total_submissions,
                dn_buffer_size=self.dn_buffer_size,
                dn_buffered=len(self.rounds.dn_buffer),
                dylu_enabled=self.dylu_enabled,
            )
            if self.dylu_enabled:
                reply["dylu_base_sync_every"] = self.dylu_base_sync_every
        if self.rounds.fragment_submissions > 0:
            reply["fragment_submissions"] = self.rounds.fragment_submissions
        if self.roster.deaths > 0:
            reply["total_worker_deaths"] = self.roster.deaths
        reply.update(
            heartbeat_timeout=self.heartbeat_timeout,
            min_workers=self.min_workers,
            outer_lr=group.get("lr", 0),
            outer_momentum=group.get("momentum", 0),
            save_dir=self.output_dir,
            model_params=self.rounds.model_params,
            model_size_mb=round(self.rounds.model_size_mb, 2),
            dashboard_enabled=self.dashboard_enabled,
            **self.outer_pause.state(),
        )
        return reply

    # -- admin routes ------------------------------------------------------------------------
    def control(self, action: str, data: dict[str, Any]) -> dict[str, Any]:
        """Forgather's admin actions and hookloop's pause/resume (``POST /control/{action}``;
        :func:`hookloop.diloco.admin.act`)."""
        return admin.act(self, action, data)

    # -- HTTP -------------------------------------------------------------------------------
    def authorized(self, header: str) -> bool:
        """Whether an ``Authorization`` header lets a request in (any, with ``disable_auth``)."""
        if self.token is None:
            return self.disable_auth
        return bearer_matches(header, self.token)

    def app(self) -> web.Application:
        """The aiohttp application serving this server's routes."""
        return DiLoCoRoutes(self).app()

    def ssl_context(self) -> ssl.SSLContext | None:
        return options.tls_context(self.certfile, self.keyfile)

    # -- running ----------------------------------------------------------------------------
    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`stop` or ``/control/shutdown``; ``ready`` once listening.
        The output dir is held meanwhile (:func:`~hookloop.diloco.lifecycle.hold_output_dir`)."""

        def listening() -> None:
            self.port = self._serving.port or self.port
            self._running, self._started_at = True, time.time()
            mode = "async" if self.async_mode else "sync"
            log.info("diloco: serving %s (mode=%s), %d worker(s) expected", self.address, mode,
                     self.num_workers)  # fmt: skip
            if self.outer_pause.paused:
                log.warning("diloco: the outer loop is paused since %s by %s, as when this "
                            "server stopped; no round advances until `hookloop diloco resume`",
                            clock(self.outer_pause.since or 0), self.outer_pause.by)  # fmt: skip
            if ready is not None:
                ready()

        with lifecycle.hold_output_dir(self.output_dir):
            options.check_exposure(self.host, self.token, self.disable_auth,
                                   self.allow_remote_without_auth)  # fmt: skip
            where = Address(host=self.host, port=self.port, ssl_context=self.ssl_context())
            try:
                await self._serving.serve(self.app(), where, listening)
            finally:
                self._running = False

    async def serve_until_signal(self, ready: Callable[[], None] | None = None) -> int | None:
        """:meth:`serve`; SIGINT or SIGTERM saves the current round (unless
        ``save_every_n_rounds`` is 0), then stops it. Returns the signal's number or None."""
        return await lifecycle.serve_until_signal(lambda: self.serve(ready), self._on_signal)

    def _on_signal(self, signum: int) -> None:
        lifecycle.save_then_stop(self, signum)

    def run(self) -> None:
        """Serve in this thread until shut down; Ctrl-C (or SIGTERM) saves first, as in
        Forgather, unless ``save_every_n_rounds`` is 0."""
        asyncio.run(self.serve_until_signal())

    def start(self, timeout: float = 15.0) -> DiLoCoServer:
        """Serve from a background thread; returns once it listens."""
        if self._running:
            raise RuntimeError("the server is already running")
        self._serving.start(self.serve, timeout)
        return self

    def request_stop(self) -> None:
        """Ask the server to stop (from any thread or a signal handler); returns at once."""
        self._serving.request_stop()

    def stop(self) -> None:
        """Stop serving (and wait for the background thread)."""
        if not self._running:
            raise RuntimeError("the server is not running")
        self._serving.stop(10)
