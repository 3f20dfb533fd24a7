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
``<output_dir>/checkpoints``; started again on the same ``output_dir`` it
continues from the newest. Routes (Forgather's): ``POST /register``,
``/submit_pseudograd``, ``/submit_fragment_pseudograd``, ``/heartbeat``,
``/deregister``, ``/control/{save_state,kick_worker,update_optimizer,
update_num_workers,shutdown}``; ``GET /status``, ``/global_params``,
``/dashboard`` (and ``/``).

hookloop's additions, which a Forgather peer does not need: a bearer
``token`` (or ``disable_auth=True`` to admit tokenless peers, loopback only
unless ``allow_remote_without_auth``), HTTPS (``certfile``/``keyfile``),
every submission checked by :func:`hookloop.diloco.validate.check_contribution`
and, unless ``max_update_ratio`` is None or 0, bounded by
:func:`~hookloop.diloco.validate.check_update_ratio`, every JSON field checked by
:mod:`hookloop.diloco.fields` (400 naming the field), a dashboard served without
the token under a strict Content-Security-Policy (:mod:`hookloop.diloco.dashboard`;
every response: :func:`hookloop.control.pages.secure`), and worker ids bound to a
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
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import logging
import math
import ssl
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hookloop.control.background import run_while_serving
from hookloop.control.bodies import BodyError, check_tree
from hookloop.control.pages import secure
from hookloop.diloco import fields, storage
from hookloop.diloco.membership import (
    SECRET_HEADER,
    Caller,
    WorkerInfo,
    check_join,
    check_member,
)
from hookloop.diloco.validate import (
    MAX_UPDATE_RATIO,
    check_contribution,
    check_same_names,
    check_update_ratio,
    norm,
)
from hookloop.diloco.wire import TENSOR_TYPE, save_tensors, unpack
from hookloop.journal import Journal

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("hookloop.diloco")

CONTROL_ACTIONS = (
    "save_state",
    "kick_worker",
    "update_optimizer",
    "update_num_workers",
    "shutdown",
)
ROUTES = (
    "POST /register, /submit_pseudograd, /submit_fragment_pseudograd, /heartbeat, /deregister, "
    f"/control/{{{','.join(CONTROL_ACTIONS)}}}; GET /status, /global_params, /dashboard"
)
#: The longest heartbeat timeout accepted (0 disables eviction).
MAX_HEARTBEAT_TIMEOUT = 86400.0
#: Refused submissions in a row after which a worker is evicted (and answered 409 after).
MAX_REFUSALS = 3


class ProtocolError(ValueError):
    """A request the server refuses; ``status`` is its HTTP code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    from hookloop.control.server import is_loopback as _is_loopback

    return _is_loopback(host)


def _number(name: str, value: Any, *, low: float, high: float | None = None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < low or (high is not None and value > high):
        span = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ValueError(f"{name} must be a number {span}, got {value!r}")
    return float(value)


def _momentum(name: str, value: Any) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _integer(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class DiLoCoServer:
    """Forgather's ``DiLoCoServer`` (same constructor and methods) served on aiohttp.

    ``start()`` serves from a background thread, ``run()`` in the caller's
    until ``/control/shutdown`` or Ctrl-C; ``address`` and ``port`` say where
    (``port=0`` picks a free one). The keyword-only arguments are hookloop's.
    """

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
        self.num_workers = _integer("num_workers", num_workers, 1)
        self.min_workers = _integer("min_workers", min_workers, 1)
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"host must be an address to bind (e.g. 127.0.0.1), got {host!r}")
        port = 8512 if port is None else port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535] (0: any free), got {port!r}")
        self.host, self.port = host, port
        self.output_dir = str(output_dir)
        self.save_every_n_rounds = _integer("save_every_n_rounds", save_every_n_rounds, 0)
        self.save_total_limit = _integer("save_total_limit", save_total_limit, 0)
        self.async_mode = bool(async_mode)
        self.safetensors = bool(safetensors)  # checkpoints are always safetensors here
        self.dn_buffer_size = _integer("dn_buffer_size", dn_buffer_size, 0)
        self.dylu_enabled = bool(dylu_enabled)
        self.dylu_base_sync_every = _integer("dylu_base_sync_every", dylu_base_sync_every, 1)
        self.heartbeat_timeout = _number(
            "heartbeat_timeout", heartbeat_timeout, low=0, high=MAX_HEARTBEAT_TIMEOUT
        )
        self.dashboard_enabled = bool(dashboard_enabled)
        self.sync_timeout = _number("sync_timeout", sync_timeout, low=0.001)
        if max_payload_mb is not None:
            _integer("max_payload_mb", max_payload_mb, 1)
        self.max_refusals = _integer("max_refusals", max_refusals, 1)
        if not isinstance(allow_unbound_workers, bool):
            raise ValueError(
                f"allow_unbound_workers must be True or False, got {allow_unbound_workers!r}"
            )
        self.allow_unbound_workers = allow_unbound_workers
        if max_update_ratio is not None:
            _number("max_update_ratio", max_update_ratio, low=0)
        self.max_update_ratio = max_update_ratio or None
        storage.check_output_dir(self.output_dir)
        self._check_auth(token, disable_auth, allow_remote_without_auth)
        self.token, self.disable_auth = token, disable_auth
        self.allow_remote_without_auth = allow_remote_without_auth
        if (certfile is None) != (keyfile is None):
            raise ValueError("HTTPS needs both certfile and keyfile (got only one)")
        for what, file in (("certfile", certfile), ("keyfile", keyfile)):
            if file is not None and not Path(file).is_file():
                raise FileNotFoundError(
                    f"{what} {file} {'is not a file' if Path(file).exists() else 'does not exist'}"
                    "; give the PEM file for HTTPS"
                )
        self.certfile, self.keyfile = certfile, keyfile
        if outer_optimizer_factory is None:
            _number("outer_lr", outer_lr, low=1e-12)
            _momentum("outer_momentum", outer_momentum)
            if nesterov and outer_momentum == 0:
                raise ValueError("nesterov=True needs outer_momentum > 0 (or pass nesterov=False)")

            def outer_optimizer_factory(params: Any) -> torch.optim.Optimizer:
                return torch.optim.SGD(
                    params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
                )

        self.outer_optimizer_factory = outer_optimizer_factory
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self.load_state(from_checkpoint)
        if max_payload_mb is None:  # the largest honest body: the model in float64
            max_payload_mb = math.ceil(self._model_params * 8 / 2**20) + 64
        self.max_payload_mb = max_payload_mb

    @staticmethod
    def _check_auth(token: Any, disable_auth: Any, allow_remote: Any) -> None:
        for name, flag in (
            ("disable_auth", disable_auth),
            ("allow_remote_without_auth", allow_remote),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if token is not None and (
            not isinstance(token, str) or len(token) < 16 or not token.isascii()
            or not token.isprintable() or " " in token
        ):  # fmt: skip
            raise ValueError(
                "token must be a printable ASCII string of at least 16 characters without spaces"
            )
        if token is not None and disable_auth:
            raise ValueError("pass either token= or disable_auth=True, not both")

    # -- state ------------------------------------------------------------------------
    def _initialize(self, weights: dict[str, torch.Tensor]) -> None:
        for name, value in weights.items():
            if not value.is_floating_point():
                raise ValueError(f"checkpoint tensor {name} is {value.dtype}, not floating point")
        self._param_names = list(weights)
        self._index = {n: i for i, n in enumerate(self._param_names)}
        self._params = [
            torch.nn.Parameter(v.detach().clone().float().cpu(), requires_grad=False)
            for v in weights.values()
        ]
        self.outer_optimizer = self.outer_optimizer_factory(self._params)
        self._outer_lr = float(self.outer_optimizer.param_groups[0]["lr"])
        self._model_params = sum(v.numel() for v in weights.values())
        self._model_size_mb = sum(v.numel() * v.element_size() for v in weights.values()) / 2**20
        self._workers: dict[str, WorkerInfo] = {}
        self._sync_round = 0
        self._total_submissions = 0
        self._fragment_submissions = 0
        self._total_worker_deaths = 0
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._round_done: dict[int, asyncio.Future[dict[str, torch.Tensor]]] = {}
        self._expected: set[str] | None = None
        self._excused: dict[int | None, set[str]] = {}  # refused this round (None: full)
        self._frag_pending: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self._frag_rounds: dict[int, int] = {}
        self._frag_done: dict[tuple[int, int], asyncio.Future[dict[str, torch.Tensor]]] = {}
        self._dn_buffer: list[dict[str, torch.Tensor]] = []
        self._dirty = False
        self._refusals: dict[str, int] = {}
        self._evicted: dict[str, str] = {}
        self._norm: float | None = None  # of the global weights; None: not known since a step

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
        self._initialize(storage.load_weights(checkpoint_path))
        state = storage.load_server_state(checkpoint_path)
        if state is None:
            log.info("diloco: global weights from %s (no server state: round 0)", checkpoint_path)
            return
        names = state.get("param_names")
        if names is not None and list(names) != self._param_names:
            raise ValueError(f"{checkpoint_path}: server_state.pt names other parameters")
        try:
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            raise ValueError(
                f"{checkpoint_path}: server_state.pt's outer_optimizer does not fit: {err}"
            ) from None
        self._outer_lr = float(self.outer_optimizer.param_groups[0]["lr"])
        self._sync_round = int(state["sync_round"])
        self._total_submissions = int(state.get("total_submissions", 0))
        log.info("diloco: continuing from %s at round %d", checkpoint_path, self._sync_round)

    def save_state(self, path: str | None = None) -> None:
        """Save weights and server state (skipped when nothing changed since the last save)."""
        if not self._running:
            raise RuntimeError("the server is not running")
        if not self._dirty:
            log.info("diloco: nothing changed since the last save; not saving")
            return
        target = Path(path) if path is not None else (
            Path(self.output_dir) / "checkpoints" / f"checkpoint-{self._sync_round}"
        )  # fmt: skip
        storage.save(target, self.get_global_params(), self._server_state())
        log.info("diloco: saved %s", target)
        if path is None:
            storage.rotate(self.output_dir, self.save_total_limit)
        self._dirty = False

    def _server_state(self) -> dict[str, Any]:
        return {
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "sync_round": self._sync_round,
            "num_workers": self.num_workers,
            "param_names": list(self._param_names),
            "async_mode": self.async_mode,
            "total_submissions": self._total_submissions,
        }

    def get_global_params(self) -> dict[str, torch.Tensor]:
        """A copy of the global weights (float32)."""
        return {n: p.detach().clone() for n, p in zip(self._param_names, self._params, strict=True)}

    def _params_named(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self._params[self._index[n]].detach().clone() for n in names}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- outer steps --------------------------------------------------------------------
    @torch.no_grad()
    def _outer_step(self, contributions: list[dict[str, torch.Tensor]]) -> None:
        """One outer step on the mean of ``contributions`` (their names only).

        All or nothing: when the step raises or leaves a weight non-finite, the weights
        and the optimizer's state are put back as they were and ``RuntimeError`` says why.
        """
        names = list(contributions[0])
        touched = [self._params[self._index[n]] for n in names]
        saved = [p.detach().clone() for p in touched]
        saved_opt = copy.deepcopy(self.outer_optimizer.state_dict())
        try:
            for name, param in zip(names, touched, strict=True):
                total = contributions[0][name].float().clone()
                for other in contributions[1:]:
                    total.add_(other[name].float())
                param.grad = total.div_(len(contributions))
            self.outer_optimizer.step()
            bad = [n for n, p in zip(names, touched, strict=True) if not p.isfinite().all()]
            if bad:
                raise RuntimeError(f"the step made {bad[:3]} non-finite")
        except Exception as err:
            for param, value in zip(touched, saved, strict=True):
                param.copy_(value)
            self.outer_optimizer.load_state_dict(saved_opt)
            raise RuntimeError(
                f"the outer step failed ({' '.join(str(err).split())[:200]}); the global "
                "weights and the outer optimizer are unchanged"
            ) from None
        finally:
            self.outer_optimizer.zero_grad(set_to_none=True)
        self._dirty, self._norm = True, None

    def _after_round(self) -> None:
        if self.save_every_n_rounds > 0 and self._sync_round % self.save_every_n_rounds == 0:
            try:
                self.save_state()
            except Exception as err:  # a failed save must not fail the round
                log.error(
                    "diloco: saving round %d failed (%s); the previous checkpoint is kept and "
                    "the next round tries again", self._sync_round, _line(err)
                )  # fmt: skip

    def _expected_count(self, key: int | None = None) -> int:
        """How many submissions close the round ``key`` (None: full model, else a fragment):
        the expected workers less those whose contribution was refused in it."""
        excused = self._excused.get(key, set())
        if self._expected is None:
            return self.num_workers - len(excused)
        return len(self._expected - excused)

    def _snapshot_expected(self) -> None:
        self._expected = set(self._workers)

    def _release_full(self) -> None:
        """Close the full-model round when every expected worker has submitted."""
        if not self._pending or len(self._pending) < self._expected_count(None):
            return
        done_round = self._sync_round
        self._excused.pop(None, None)
        try:
            self._outer_step(list(self._pending.values()))
        except Exception as err:  # every waiter is answered; the next round starts clean
            log.error("diloco: round %d: %s", done_round, _line(err))
            self._pending.clear()
            self._fail(self._round_done.pop(done_round, None), err)
            self._snapshot_expected()
            return
        self._pending.clear()
        self._sync_round += 1
        log.info("diloco: outer step done, round %d", self._sync_round)
        self._future(self._round_done, done_round).set_result(self.get_global_params())
        self._snapshot_expected()
        for old in [r for r in self._round_done if r < done_round - 1]:
            del self._round_done[old]
        self._after_round()

    def _release_fragment(self, frag: int) -> None:
        pending = self._frag_pending.get(frag) or {}
        if not pending or len(pending) < self._expected_count(frag):
            return
        self._excused.pop(frag, None)
        done_round = self._frag_rounds.get(frag, 0)
        contributions = list(pending.values())
        try:
            self._outer_step(contributions)
        except Exception as err:  # every waiter is answered; the next round starts clean
            log.error("diloco: fragment %d round %d: %s", frag, done_round, _line(err))
            pending.clear()
            self._fail(self._frag_done.pop((frag, done_round), None), err)
            return
        result = self._params_named(list(contributions[0]))
        pending.clear()
        self._frag_rounds[frag] = done_round + 1
        self._fragment_submissions += len(contributions)
        self._sync_round += 1
        self._future(self._frag_done, (frag, done_round)).set_result(result)
        for key in [k for k in self._frag_done if k[0] == frag and k[1] < done_round - 1]:
            del self._frag_done[key]

    @staticmethod
    def _fail(future: asyncio.Future[Any] | None, err: BaseException) -> None:
        if future is not None and not future.done():
            future.set_exception(ProtocolError(f"DiLoCo server error: {_line(err)}", 500))
            future.add_done_callback(lambda f: f.exception())  # retrieved: no warning

    @staticmethod
    def _future(table: dict[Any, asyncio.Future[Any]], key: Any) -> asyncio.Future[Any]:
        future = table.get(key)
        if future is None:
            future = table[key] = asyncio.get_running_loop().create_future()
        return future

    @torch.no_grad()
    def _apply_async(self, grads: dict[str, torch.Tensor]) -> None:
        if self.dn_buffer_size <= 0:
            self._outer_step([grads])
        else:
            self._dn_buffer.append(grads)
            if len(self._dn_buffer) >= self.dn_buffer_size:
                buffered, self._dn_buffer = self._dn_buffer, []
                self._outer_step(buffered)
            else:  # between momentum steps: plain descent, no momentum
                for name, value in grads.items():
                    param = self._params[self._index[name]]
                    new = param - self._outer_lr * value.float()
                    if not new.isfinite().all():
                        self._dn_buffer.pop()
                        raise RuntimeError(
                            f"the step would make {name} non-finite; the global weights are "
                            "unchanged"
                        )
                    param.copy_(new)
                self._dirty, self._norm = True, None
        self._sync_round += 1
        self._total_submissions += 1
        self._after_round()

    def deregister(self, worker_id: str, caller: Caller | None = None) -> None:
        """A worker leaves; an id not registered is a no-op (as Forgather answers it)."""
        if worker_id in self._workers:
            self._check_member(worker_id, caller)
            self.worker_left(worker_id)

    def worker_left(self, worker_id: str) -> None:
        """Drop a worker (left, kicked or silent) and release the barriers it held up."""
        if self._workers.pop(worker_id, None) is None:
            return
        self._total_worker_deaths += 1
        self.num_workers = max(self.min_workers, len(self._workers))
        log.warning("diloco: worker %s gone; %d remain", worker_id, len(self._workers))
        self._pending.pop(worker_id, None)
        if self._expected is not None:
            self._expected.discard(worker_id)
        for excused in self._excused.values():
            excused.discard(worker_id)
        self._release_full()
        for frag, pending in self._frag_pending.items():
            pending.pop(worker_id, None)
            self._release_fragment(frag)

    def evict_silent(self, now: float | None = None) -> list[str]:
        """Drop the workers whose last heartbeat is older than ``heartbeat_timeout``."""
        if self.heartbeat_timeout <= 0:
            return []
        now = time.time() if now is None else now
        silent = [
            w for w, i in self._workers.items() if now - i.last_heartbeat > self.heartbeat_timeout
        ]
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
        speeds = {w: i.steps_per_second for w, i in self._workers.items() if i.steps_per_second > 0}
        if worker_id not in speeds:
            return None
        return max(1, int(speeds[worker_id] / max(speeds.values()) * self.dylu_base_sync_every))

    # -- the protocol ----------------------------------------------------------------------
    def _check_not_evicted(self, worker_id: str) -> None:
        reason = self._evicted.get(worker_id)
        if reason is not None:
            raise ProtocolError(
                f"worker {worker_id} was evicted after {self.max_refusals} refused "
                f"contributions (last: {reason[:300]}); fix the worker and start it under "
                "a new worker id",
                409,
            )

    def _refuse(self, worker_id: str, error: str, fragment: Any = None) -> ProtocolError:
        """Count a refused contribution: its sender sits this round out; evicted at the limit."""
        count = self._refusals[worker_id] = self._refusals.get(worker_id, 0) + 1
        log.error("diloco: refused (%d/%d): %s", count, self.max_refusals, error)
        if worker_id in self._workers and count >= self.max_refusals:
            self._evicted[worker_id] = error
            log.error("diloco: evicting %s after %d refused contributions", worker_id, count)
            self.worker_left(worker_id)
        elif not self.async_mode and worker_id in self._workers:
            # The others' round goes on without it (it may still send a valid one).
            valid = fragment is None or (
                isinstance(fragment, int) and not isinstance(fragment, bool) and fragment >= 0
            )
            key = fragment if valid else None
            pending = self._pending if key is None else self._frag_pending.get(key, {})
            if valid and worker_id not in pending:
                self._excused.setdefault(key, set()).add(worker_id)
                if key is None:
                    self._release_full()
                else:
                    self._release_fragment(key)
        return ProtocolError(error)

    def _check_member(self, worker_id: str, caller: Caller | None) -> WorkerInfo:
        """The registration ``caller`` may act for, or 404/403 (it counts nothing)."""
        info = self._workers.get(worker_id)
        refusal = check_member(worker_id, info, caller or Caller())
        if refusal is not None:
            log.warning("diloco: refused a request under %s: %s", worker_id[:200],
                        refusal.message)  # fmt: skip
            raise ProtocolError(refusal.message, refusal.status)
        assert info is not None
        return info

    def register(
        self, info: dict[str, Any], caller: Caller | None = None
    ) -> dict[str, torch.Tensor]:
        """Admit (or admit again) a worker; its secret is then ``secret_of(worker_id)``."""
        worker_id = _worker_id(info)
        self._check_not_evicted(worker_id)
        caller = caller or Caller()
        old = self._workers.get(worker_id)
        refusal = check_join(worker_id, old, caller, allow_unbound=self.allow_unbound_workers)
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
        self._workers[worker_id] = new
        self.num_workers = max(self.num_workers, len(self._workers))
        log.info(
            "diloco: worker %s registered (%d/%d)", worker_id, len(self._workers), self.num_workers
        )
        return self.get_global_params()

    def secret_of(self, worker_id: str) -> str:
        """The secret ``/register`` issued to ``worker_id`` (its reply's X-Worker-Secret)."""
        return self._workers[worker_id].secret

    def _accept(
        self, body: bytes, caller: Caller | None, *, fragment: bool
    ) -> tuple[str, Any, dict[str, torch.Tensor]]:
        try:
            header, grads = unpack(body)
            check_tree(header)
        except (ValueError, RecursionError) as err:
            raise ProtocolError(f"bad submission body: {_line(err)}") from None
        worker_id = _worker_id(header)
        self._check_not_evicted(worker_id)
        self._check_member(worker_id, caller)
        frag = None
        if fragment:
            frag = header.get("fragment_id")
            if isinstance(frag, bool) or not isinstance(frag, int) or not 0 <= frag < 4096:
                raise self._refuse(
                    worker_id, f"fragment_id must be an int in [0, 4096), got {frag!r}", frag
                )
        error = check_contribution(worker_id, grads, self._globals_view(), fragment=frag)
        others = (self._frag_pending.get(frag) or {}) if frag is not None else {}
        if error is None and others and not self.async_mode:
            first = next(iter(others.values()))
            error = check_same_names(worker_id, frag, set(grads), set(first))
        if error is None and self.max_update_ratio is not None:
            error = check_update_ratio(
                worker_id, grads, self._weights_norm(), self.max_update_ratio, fragment=frag
            )
        if error is not None:
            raise self._refuse(worker_id, error, frag)
        self._refusals.pop(worker_id, None)
        self._excused.get(frag, set()).discard(worker_id)
        return worker_id, frag, grads

    def _weights_norm(self) -> float:
        """The norm of all global weights, computed once after each change."""
        if self._norm is None:
            self._norm = norm(self._params)
        return self._norm

    def _globals_view(self) -> dict[str, torch.Tensor]:
        return dict(zip(self._param_names, self._params, strict=True))

    def _touch(self, worker_id: str) -> WorkerInfo | None:
        info = self._workers.get(worker_id)
        if info is not None:
            info.last_heartbeat = time.time()
        return info

    async def submit(self, body: bytes, caller: Caller | None = None) -> dict[str, torch.Tensor]:
        worker_id, _, grads = self._accept(body, caller, fragment=False)
        info = self._touch(worker_id)
        if self.async_mode:
            if info is not None:
                info.sync_round += 1
                info.last_sync_server_round = self._sync_round + 1
            try:
                self._apply_async(grads)
            except RuntimeError as err:
                log.error("diloco: %s", _line(err))
                raise ProtocolError(f"DiLoCo server error: {_line(err)}", 500) from None
            return self.get_global_params()
        my_round = self._sync_round
        if self._expected is None:
            self._snapshot_expected()
        self._pending[worker_id] = grads
        if info is not None:
            info.sync_round += 1
            info.last_sync_server_round = my_round + 1
        done = self._future(self._round_done, my_round)
        self._release_full()
        return await self._wait(done, "Sync timeout")

    async def submit_fragment(
        self, body: bytes, caller: Caller | None = None
    ) -> dict[str, torch.Tensor]:
        worker_id, frag, grads = self._accept(body, caller, fragment=True)
        self._touch(worker_id)
        if self.async_mode:
            try:
                self._outer_step([grads])
            except RuntimeError as err:
                log.error("diloco: %s", _line(err))
                raise ProtocolError(f"DiLoCo server error: {_line(err)}", 500) from None
            self._sync_round += 1
            self._total_submissions += 1
            self._fragment_submissions += 1
            return self._params_named(list(grads))
        my_round = self._frag_rounds.setdefault(frag, 0)
        self._frag_pending.setdefault(frag, {})[worker_id] = grads
        done = self._future(self._frag_done, (frag, my_round))
        self._release_fragment(frag)
        return await self._wait(done, "Fragment sync timeout")

    async def _wait(self, done: asyncio.Future[Any], message: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.sync_timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(message, 504) from None

    def heartbeat(self, data: dict[str, Any], caller: Caller | None = None) -> dict[str, Any]:
        worker_id = _worker_id(data)
        self._check_not_evicted(worker_id)
        self._check_member(worker_id, caller)
        info = self._touch(worker_id)
        speed = data.get("steps_per_second")
        if info is not None and speed is not None:
            info.steps_per_second = _number("steps_per_second", speed, low=0, high=1e9)
        answer: dict[str, Any] = {
            "status": "ok",
            "sync_round": self._sync_round,
            "num_workers": self.num_workers,
            "num_registered": len(self._workers),
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
            "sync_round": self._sync_round,
            "num_workers": self.num_workers,
            "num_registered": len(self._workers),
            "workers": {
                w: {
                    "hostname": i.hostname,
                    "registered_at": i.registered_at,
                    "last_heartbeat": i.last_heartbeat,
                    "sync_round": i.sync_round,
                    "last_sync_server_round": i.last_sync_server_round,
                    "steps_per_second": i.steps_per_second,
                }
                for w, i in self._workers.items()
            },
            "pending_submissions": [] if self.async_mode else list(self._pending),
            "started_at": self._started_at,
            "uptime_seconds": time.time() - self._started_at if self._started_at else 0,
        }
        if self.async_mode:
            reply.update(
                total_submissions=self._total_submissions,
                dn_buffer_size=self.dn_buffer_size,
                dn_buffered=len(self._dn_buffer),
                dylu_enabled=self.dylu_enabled,
            )
            if self.dylu_enabled:
                reply["dylu_base_sync_every"] = self.dylu_base_sync_every
        if self._fragment_submissions > 0:
            reply["fragment_submissions"] = self._fragment_submissions
        if self._total_worker_deaths > 0:
            reply["total_worker_deaths"] = self._total_worker_deaths
        reply.update(
            heartbeat_timeout=self.heartbeat_timeout,
            min_workers=self.min_workers,
            outer_lr=group.get("lr", 0),
            outer_momentum=group.get("momentum", 0),
            save_dir=self.output_dir,
            model_params=self._model_params,
            model_size_mb=round(self._model_size_mb, 2),
            dashboard_enabled=self.dashboard_enabled,
        )
        return reply

    # -- admin routes ------------------------------------------------------------------------
    def control(self, action: str, data: dict[str, Any]) -> dict[str, Any]:
        if action == "save_state":
            self.save_state()
            return {"status": "ok", "sync_round": self._sync_round}
        if action == "kick_worker":
            worker_id = data.get("worker_id")
            if not worker_id:
                raise ProtocolError("worker_id required")
            if worker_id not in self._workers:
                raise ProtocolError(f"Worker {str(worker_id)[:200]} not found", 404)
            self.worker_left(worker_id)
            return {"status": "ok", "worker_id": worker_id}
        if action == "update_optimizer":
            updated = {}
            try:
                if "lr" in data:
                    updated["lr"] = _number("lr", data["lr"], low=1e-12, high=1e6)
                if "momentum" in data:
                    updated["momentum"] = _momentum("momentum", data["momentum"])
            except ValueError as err:
                raise ProtocolError(str(err)) from None
            if not updated:
                raise ProtocolError("No parameters to update (provide lr and/or momentum)")
            group = self.outer_optimizer.param_groups[0]
            self._record_change(updated, {k: group.get(k) for k in updated}, data.get("client"))
            for group in self.outer_optimizer.param_groups:
                group.update(updated)
            self._outer_lr = float(self.outer_optimizer.param_groups[0]["lr"])
            log.info("diloco: outer optimizer now %s", updated)
            return {"status": "ok", **updated}
        if action == "update_num_workers":
            count = data.get("num_workers")
            if count is None:
                raise ProtocolError("num_workers required")
            if isinstance(count, bool) or not isinstance(count, int) or count < self.min_workers:
                raise ProtocolError(
                    f"num_workers must be an int >= min_workers ({self.min_workers}), got {count!r}"
                )
            self.num_workers = count
            return {"status": "ok", "num_workers": count}
        if action == "shutdown":
            if self.save_every_n_rounds > 0:
                self.save_state()
            self.request_stop()
            return {"status": "ok", "message": "Shutting down"}
        raise ProtocolError(
            f"Unknown control action: {action[:100]}; allowed: {', '.join(CONTROL_ACTIONS)}", 404
        )

    def _record_change(self, new: dict[str, Any], old: dict[str, Any], client: Any) -> None:
        """A change of the outer optimizer, as a live ``set`` of a training job is recorded:
        a log line and a record in ``<output_dir>/changes.jsonl`` (fsynced before it is
        made; the optimizer's own state, saved with each checkpoint, carries it on)."""
        who = client if isinstance(client, str) and client.isprintable() else "unknown"
        record = {
            "sync_round": self._sync_round,
            "changes": [{"key": k, "old": old[k], "new": v} for k, v in new.items()],
            "client": who[:80],
            "time": time.time(),
        }
        log.info("diloco: round %d: outer optimizer %s", self._sync_round, record["changes"])
        if self.output_dir:
            journal = Journal(Path(self.output_dir) / "changes.jsonl", fsync=True)
            journal.append(record)
            journal.close()

    # -- HTTP ----------------------------------------------------------------------------------
    def _authorized(self, header: str) -> bool:
        if self.token is None:
            return self.disable_auth
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "backslashreplace"), self.token.encode("ascii")
        )

    def app(self) -> web.Application:
        """The aiohttp application serving this server's routes."""
        from aiohttp import web

        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            return secure(await answer(request, handler))

        async def answer(request: web.Request, handler: Any) -> web.StreamResponse:
            # the dashboard page holds no secret: a browser loads it, then the token is typed
            public = request.method in ("GET", "HEAD") and request.path in ("/", "/dashboard")
            if not public and not self._authorized(request.headers.get("Authorization", "")):
                return _json(
                    {"error": "missing or wrong token: send 'Authorization: Bearer <token>'"}, 401
                )
            try:
                return await handler(request)
            except ProtocolError as err:
                return _json({"error": str(err)}, err.status)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                if exc.status == 413:
                    return _json({"error": (
                        f"the body is larger than the server's cap of {self.max_payload_mb} MB "
                        "(hookloop diloco serve --max-payload-mb)")}, 413)  # fmt: skip
                detail = f"; routes: {ROUTES}" if exc.status in (404, 405) else ""
                return _json(
                    {"error": f"Unknown endpoint: {request.path[:200]}{detail}"}, exc.status
                )
            except Exception as err:  # a server error is one line, never a wedge
                log.error("diloco: %s %s failed: %s", request.method, request.path[:200],
                          _line(err))  # fmt: skip
                return _json({"error": f"DiLoCo server error: {_line(err)}"}, 500)

        def tensors(data: dict[str, torch.Tensor]) -> web.Response:
            return web.Response(body=save_tensors(data), content_type=TENSOR_TYPE)

        def caller(request: web.Request) -> Caller:
            return Caller.from_request(request.headers, request.remote)

        async def register(request: web.Request) -> web.Response:
            info = await _json_body(request, "register")
            reply = tensors(self.register(info, caller(request)))
            reply.headers[SECRET_HEADER] = self.secret_of(_worker_id(info))
            return reply

        async def submit(request: web.Request) -> web.Response:
            return tensors(await self.submit(await request.read(), caller(request)))

        async def submit_fragment(request: web.Request) -> web.Response:
            return tensors(await self.submit_fragment(await request.read(), caller(request)))

        async def heartbeat(request: web.Request) -> web.Response:
            try:
                return _json(
                    self.heartbeat(await _json_body(request, "heartbeat"), caller(request))
                )
            except ProtocolError:
                raise
            except ValueError as err:
                raise ProtocolError(str(err)) from None

        async def deregister(request: web.Request) -> web.Response:
            self.deregister(_worker_id(await _json_body(request, "deregister")), caller(request))
            return _json({"status": "ok"})

        async def control(request: web.Request) -> web.Response:
            action = request.match_info["action"]
            return _json(self.control(action, await _json_body(request, action)))

        async def global_params(request: web.Request) -> web.Response:
            return tensors(self.get_global_params())

        async def status(request: web.Request) -> web.Response:
            return _json(self.status())

        async def dashboard(request: web.Request) -> web.Response:
            if not self.dashboard_enabled:
                return _json({"error": "Dashboard disabled"}, 404)
            from hookloop.diloco.dashboard import CSP, PAGE

            return web.Response(body=PAGE, content_type="text/html", charset="utf-8",
                                headers={"Content-Security-Policy": CSP})  # fmt: skip

        app = web.Application(middlewares=[guard], client_max_size=self.max_payload_mb * 2**20)
        for route, handler in (
            ("/register", register),
            ("/submit_pseudograd", submit),
            ("/submit_fragment_pseudograd", submit_fragment),
            ("/heartbeat", heartbeat),
            ("/deregister", deregister),
            ("/control/{action}", control),
        ):
            app.router.add_post(route, handler)
            app.router.add_post(route + "/", handler)
        for route, handler in (("/global_params", global_params), ("/status", status),
                               ("/dashboard", dashboard), ("/", dashboard)):  # fmt: skip
            app.router.add_get(route, handler)
        app.on_startup.append(self._start_health_monitor)
        return app

    async def _start_health_monitor(self, app: web.Application) -> None:
        if self.heartbeat_timeout <= 0:
            return
        period = min(self.heartbeat_timeout / 3, 30.0)

        async def monitor() -> None:
            while True:
                await asyncio.sleep(period)
                try:
                    self.evict_silent()
                except Exception as err:  # the monitor must outlive one bad eviction
                    log.error("diloco: evicting silent workers failed: %s", _line(err))

        run_while_serving(app, monitor)

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.certfile is None or self.keyfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, OSError) as err:
            raise ValueError(
                f"certfile {self.certfile} / keyfile {self.keyfile}: not a PEM certificate "
                f"and its key ({_line(err)})"
            ) from None
        return context

    # -- running -------------------------------------------------------------------------------
    def _announce(self) -> None:
        if self.token is None and not self.disable_auth:
            raise ValueError(
                "the DiLoCo server needs token= (workers send it as a bearer token) or "
                "disable_auth=True to admit tokenless peers such as Forgather's workers"
            )
        if self.disable_auth and not is_loopback(self.host) and not self.allow_remote_without_auth:
            raise ValueError(
                f"disable_auth=True on host {self.host!r} would let anyone who reaches it "
                "change the model: bind to 127.0.0.1, set a token, or also pass "
                "allow_remote_without_auth=True"
            )
        if self.disable_auth:
            where = "loopback only" if is_loopback(self.host) else "REACHABLE FROM OTHER MACHINES"
            print(
                f"WARNING: hookloop diloco: serving on {self.host} WITHOUT AUTHENTICATION "
                f"({where}): anyone who can reach it can change the model or shut it down",
                file=sys.stderr, flush=True,
            )  # fmt: skip

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`stop` or ``/control/shutdown``; ``ready`` once listening."""
        from aiohttp import web

        self._announce()
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, ssl_context=self.ssl_context(),
                           reuse_address=True)  # fmt: skip
        try:
            await site.start()
            self.port = _bound_port(runner) or self.port
            self._running, self._started_at = True, time.time()
            mode = "async" if self.async_mode else "sync"
            log.info("diloco: serving %s (mode=%s), %d worker(s) expected", self.address, mode,
                     self.num_workers)  # fmt: skip
            if ready is not None:
                ready()
            await self._stop_event.wait()
        finally:
            self._running = False
            await runner.cleanup()

    def run(self) -> None:
        """Serve in this thread until shut down (Ctrl-C saves first, as Forgather)."""
        try:
            asyncio.run(self.serve())
        except KeyboardInterrupt:
            log.info("diloco: interrupted")

    def start(self, timeout: float = 15.0) -> DiLoCoServer:
        """Serve from a background thread; returns once it listens."""
        if self._running:
            raise RuntimeError("the server is already running")
        ready, failed = threading.Event(), []

        def main() -> None:
            try:
                asyncio.run(self.serve(ready.set))
            except BaseException as err:  # handed to start()
                failed.append(err)
                ready.set()

        self._thread = threading.Thread(target=main, name="hookloop-diloco", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"the DiLoCo server did not start within {timeout:.0f} s")
        if failed:
            raise failed[0]
        return self

    def request_stop(self) -> None:
        """Ask the server to stop (from any thread or a signal handler); returns at once."""
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def stop(self) -> None:
        """Stop serving (and wait for the background thread)."""
        if not self._running:
            raise RuntimeError("the server is not running")
        self.request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)


def _line(err: BaseException) -> str:
    return " ".join(str(err).split())[:500] or type(err).__name__


def _bound_port(runner: Any) -> int | None:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        for sock in getattr(server, "sockets", None) or []:
            return int(sock.getsockname()[1])
    return None


def _worker_id(data: dict[str, Any]) -> str:
    try:
        return fields.worker_id(data.get("worker_id"))
    except BodyError as err:
        raise ProtocolError(str(err)) from None


async def _json_body(request: web.Request, route: str) -> dict[str, Any]:
    """The body's JSON object, each field ``route`` reads checked (400 naming the field)."""
    try:
        return fields.read_body(route, await request.read())
    except BodyError as err:
        raise ProtocolError(str(err)) from None


def _json(data: Any, status: int = 200) -> web.Response:
    from aiohttp import web

    return web.json_response(data, status=status)
