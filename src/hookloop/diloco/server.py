"""The DiLoCo server: global weights, the outer optimizer, and who is in the round.

Workers train on their own and, every ``sync_every`` local steps, send their
pseudo-gradient for one fragment of the parameters (all of them when there is
one fragment). The server averages what arrived for that fragment's round,
takes the outer Nesterov step (:mod:`hookloop.diloco.outer`) and answers every
waiting worker with the fragment's new weights.

Membership is elastic. A worker joins at any time and starts from the current
global weights. A round expects the workers that were live when its first
pseudo-gradient arrived; it closes once all of them still alive have sent
(and at least ``min_workers`` have), or when ``round_timeout`` seconds have
passed since it opened. A worker whose heartbeats stop for three of its
heartbeat intervals is dropped, so no round waits on a dead worker. A
pseudo-gradient for a round already closed is stale: it is not applied, and
its sender gets the current weights to continue from.

After every round the server writes its state (weights, momentum, rounds,
members) atomically to ``checkpoint_dir``; started again on that directory it
continues, and gives the members it remembers a heartbeat timeout's grace to
come back before a round goes on without them.

Routes (each needs ``Authorization: Bearer <token>`` when a token is set):

=====================  ===================================================
``POST /v1/join``      payload: the worker's weights; answer: global weights
``POST /v1/sync``      payload: one fragment's pseudo-gradient; answer (when
                       the round closes): the fragment's new weights
``POST /v1/heartbeat`` JSON ``{"worker_id", "steps_per_sec"}``
``POST /v1/leave``     JSON ``{"worker_id"}``
``GET  /v1/status``    JSON: rounds, members, settings
=====================  ===================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hookloop.control.background import run_while_serving
from hookloop.diloco.outer import OuterOptimizer, check_outer_settings, mean_of
from hookloop.diloco.wire import CONTENT_TYPE, decode, encode, split_fragments

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("hookloop.diloco")

#: The server's state file inside ``checkpoint_dir``.
STATE_FILE = "diloco-server.pt"
ROUTES = "POST /v1/join, POST /v1/sync, POST /v1/heartbeat, POST /v1/leave, GET /v1/status"
_REAP_EVERY_S = 0.1


@dataclass
class ServerSettings:
    """What ``hookloop diloco serve`` is started with (validated by :meth:`check`)."""

    host: str = "127.0.0.1"
    port: int = 8512
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    min_workers: int = 1
    round_timeout: float = 600.0
    checkpoint_dir: str | None = None
    token: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    max_payload_mb: int = 8192

    def check(self) -> ServerSettings:
        check_outer_settings(self.outer_lr, self.outer_momentum, self.nesterov)
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"host must be an address to bind (e.g. 127.0.0.1), got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must lie in [0, 65535], got {self.port!r}")
        if isinstance(self.min_workers, bool) or not isinstance(self.min_workers, int):
            raise ValueError(f"min_workers must be an int >= 1, got {self.min_workers!r}")
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be an int >= 1, got {self.min_workers!r}")
        if not isinstance(self.round_timeout, (int, float)) or not self.round_timeout > 0:
            raise ValueError(f"round_timeout must be seconds > 0, got {self.round_timeout!r}")
        if self.token is not None and (
            len(self.token) < 16 or not self.token.isascii() or not self.token.isprintable()
        ):
            raise ValueError(
                "token must be a printable ASCII string of at least 16 characters "
                f"(got {len(self.token)} characters)"
            )
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("HTTPS needs both certfile and keyfile (got only one)")
        if not isinstance(self.max_payload_mb, int) or self.max_payload_mb < 1:
            raise ValueError(f"max_payload_mb must be an int >= 1, got {self.max_payload_mb!r}")
        return self


@dataclass
class Member:
    worker_id: str
    heartbeat_interval: float
    last_seen: float
    steps_per_sec: float | None = None


@dataclass
class Fragment:
    """One fragment's global weights, momentum and current round."""

    names: list[str]
    outer: OuterOptimizer
    round: int = 0
    pending: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    waiting: dict[str, asyncio.Future[bytes]] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    opened_at: float | None = None


class ProtocolError(ValueError):
    """A request the server refuses; ``status`` is its HTTP code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class DiLoCoServer:
    """The state and rules of the server; :meth:`app` serves them over aiohttp."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings.check()
        self.members: dict[str, Member] = {}
        self.fragments: list[Fragment] = []
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.rounds_closed = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        if settings.checkpoint_dir is not None:
            self._load()

    # -- state --------------------------------------------------------------------
    @property
    def initialised(self) -> bool:
        return bool(self.fragments)

    def _init_model(
        self, weights: dict[str, torch.Tensor], num_fragments: int, order: Any = None
    ) -> None:
        # A payload's tensors come back in no particular order: use the model's, when sent.
        names = order if isinstance(order, list) and sorted(order) == sorted(weights) else None
        names = names or sorted(weights)
        groups = split_fragments([(n, weights[n].numel()) for n in names], num_fragments)
        s = self.settings
        self.shapes = {n: list(weights[n].shape) for n in names}
        self.dtypes = {n: weights[n].dtype for n in names}
        self.fragments = [
            Fragment(
                names=g,
                outer=OuterOptimizer(
                    [weights[n].to(torch.float32) for n in g],
                    lr=s.outer_lr,
                    momentum=s.outer_momentum,
                    nesterov=s.nesterov,
                ),
            )
            for g in groups
        ]

    def _check_model(self, weights: dict[str, torch.Tensor], num_fragments: int) -> None:
        shapes = {n: list(t.shape) for n, t in weights.items()}
        if shapes != self.shapes:
            missing = sorted(set(self.shapes) - set(shapes))[:5]
            extra = sorted(set(shapes) - set(self.shapes))[:5]
            differ = sorted(n for n in shapes if n in self.shapes and shapes[n] != self.shapes[n])
            differ = differ[:5]
            raise ProtocolError(
                "this worker's model is not the server's: "
                f"missing {missing}, unexpected {extra}, other shapes {differ}",
                409,
            )
        if num_fragments != len(self.fragments):
            raise ProtocolError(
                f"num_fragments={num_fragments}, but the server runs "
                f"{len(self.fragments)} fragments; start every worker with the same value",
                409,
            )

    def global_weights(self, fragment: int | None = None) -> dict[str, torch.Tensor]:
        """The current global weights (of one fragment, or all), in their own dtypes."""
        frags = self.fragments if fragment is None else [self.fragments[fragment]]
        return {
            n: w.to(self.dtypes[n])
            for frag in frags
            for n, w in zip(frag.names, frag.outer.weights, strict=True)
        }

    def live_ids(self) -> set[str]:
        return set(self.members)

    def fastest(self) -> float | None:
        speeds = [m.steps_per_sec for m in self.members.values() if m.steps_per_sec]
        return max(speeds) if speeds else None

    def _seen(self, worker_id: str, steps_per_sec: Any = None) -> Member:
        member = self.members.get(worker_id)
        if member is None:  # not joined, or dropped while it was away: it is back
            member = self.members[worker_id] = Member(worker_id, 30.0, time.monotonic())
            log.info("diloco: worker %s is back", worker_id)
        member.last_seen = time.monotonic()
        if isinstance(steps_per_sec, (int, float)) and steps_per_sec > 0:
            member.steps_per_sec = float(steps_per_sec)
        return member

    # -- the protocol (called on the event loop) ----------------------------------
    def join(self, body: bytes) -> bytes:
        weights, meta = _payload(body)
        worker_id = _worker_id(meta)
        num_fragments = meta.get("num_fragments", 1)
        interval = meta.get("heartbeat_interval", 30.0)
        if not isinstance(interval, (int, float)) or not interval > 0:
            raise ProtocolError(f"heartbeat_interval must be seconds > 0, got {interval!r}")
        if not self.initialised:
            try:
                self._init_model(weights, num_fragments, meta.get("names"))
            except ValueError as err:
                raise ProtocolError(str(err)) from None
            log.info("diloco: global weights from worker %s (%d tensors)", worker_id, len(weights))
            self._save()
        else:
            self._check_model(weights, num_fragments)
        self.members[worker_id] = Member(worker_id, float(interval), time.monotonic())
        log.info("diloco: worker %s joined (%d live)", worker_id, len(self.members))
        return encode(self.global_weights(), self._meta(worker_id=worker_id))

    async def sync(self, body: bytes) -> bytes:
        grads, meta = _payload(body)
        worker_id = _worker_id(meta)
        if not self.initialised:
            raise ProtocolError("no global weights yet: POST /v1/join first", 409)
        index, round_ = meta.get("fragment"), meta.get("round")
        if not isinstance(index, int) or not 0 <= index < len(self.fragments):
            raise ProtocolError(
                f"fragment must be an int in [0, {len(self.fragments)}), got {index!r}"
            )
        if not isinstance(round_, int):
            raise ProtocolError(f"round must be an int, got {round_!r}")
        self._seen(worker_id, meta.get("steps_per_sec"))
        frag = self.fragments[index]
        if round_ != frag.round:  # the round it trained for is over: start from now
            return encode(self.global_weights(index), self._meta(index, stale=True))
        if sorted(grads) != sorted(frag.names):
            raise ProtocolError(
                f"fragment {index} holds {len(frag.names)} tensors "
                f"({', '.join(frag.names[:3])}...), the payload {len(grads)}",
            )
        if not frag.pending:
            frag.opened_at = time.monotonic()
            frag.expected = self.live_ids()
        frag.pending[worker_id] = [grads[n] for n in frag.names]
        future = frag.waiting.get(worker_id)
        if future is None or future.done():
            future = frag.waiting[worker_id] = asyncio.get_running_loop().create_future()
        self.maybe_close(index)
        return await asyncio.shield(future)

    def heartbeat(self, data: dict[str, Any]) -> dict[str, Any]:
        self._seen(_worker_id(data), data.get("steps_per_sec"))
        return {"fastest_steps_per_sec": self.fastest(), "live": len(self.members)}

    def leave(self, data: dict[str, Any]) -> dict[str, Any]:
        worker_id = _worker_id(data)
        if self.members.pop(worker_id, None) is not None:
            log.info("diloco: worker %s left (%d live)", worker_id, len(self.members))
        self.close_due_rounds()
        return {"live": len(self.members)}

    def status(self) -> dict[str, Any]:
        return {
            "rounds": [f.round for f in self.fragments],
            "rounds_closed": self.rounds_closed,
            "num_fragments": len(self.fragments),
            "members": sorted(self.members),
            "pending": [sorted(f.pending) for f in self.fragments],
            "fastest_steps_per_sec": self.fastest(),
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "outer_lr": self.settings.outer_lr,
            "outer_momentum": self.settings.outer_momentum,
            "min_workers": self.settings.min_workers,
        }

    # -- rounds -------------------------------------------------------------------
    def reap(self, now: float | None = None) -> None:
        """Drop members whose heartbeats stopped, then close the rounds that are due."""
        now = time.monotonic() if now is None else now
        for worker_id, member in list(self.members.items()):
            if now - member.last_seen > 3 * member.heartbeat_interval:
                del self.members[worker_id]
                log.warning(
                    "diloco: worker %s dropped: no heartbeat for %.1f s",
                    worker_id,
                    now - member.last_seen,
                )
        self.close_due_rounds(now)

    def close_due_rounds(self, now: float | None = None) -> None:
        for index in range(len(self.fragments)):
            self.maybe_close(index, now)

    def maybe_close(self, index: int, now: float | None = None) -> None:
        frag = self.fragments[index]
        if not frag.pending or frag.opened_at is None:
            return
        now = time.monotonic() if now is None else now
        awaited = (frag.expected & self.live_ids()) - set(frag.pending)
        enough = len(frag.pending) >= self.settings.min_workers
        if (not awaited and enough) or now - frag.opened_at >= self.settings.round_timeout:
            self._close(index)

    def _close(self, index: int) -> None:
        frag = self.fragments[index]
        senders = sorted(frag.pending)  # a fixed order: the sum does not depend on arrival
        frag.outer.step(mean_of([frag.pending[w] for w in senders]))
        frag.round += 1
        frag.pending.clear()
        frag.opened_at = None
        self.rounds_closed += 1
        self._save()
        answer = encode(self.global_weights(index), self._meta(index, contributors=len(senders)))
        for future in frag.waiting.values():
            if not future.done():
                future.set_result(answer)
        frag.waiting.clear()
        log.info(
            "diloco: fragment %d round %d closed with %d of %d live workers",
            index,
            frag.round,
            len(senders),
            len(self.members),
        )

    def _meta(self, fragment: int | None = None, **extra: Any) -> dict[str, Any]:
        meta = {
            "rounds": [f.round for f in self.fragments],
            "fragments": [f.names for f in self.fragments],
            "fastest_steps_per_sec": self.fastest(),
            **extra,
        }
        if fragment is not None:
            meta["fragment"] = fragment
            meta["round"] = self.fragments[fragment].round
        return meta

    # -- checkpoint ---------------------------------------------------------------
    @property
    def state_path(self) -> Path | None:
        d = self.settings.checkpoint_dir
        return None if d is None else Path(d) / STATE_FILE

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "shapes": self.shapes,
            "dtypes": {n: str(d).removeprefix("torch.") for n, d in self.dtypes.items()},
            "fragments": [
                {"names": f.names, "round": f.round, "outer": f.outer.state_dict()}
                for f in self.fragments
            ],
            "members": {w: m.heartbeat_interval for w, m in sorted(self.members.items())},
            "rounds_closed": self.rounds_closed,
        }

    def _save(self) -> None:
        path = self.state_path
        if path is None or not self.initialised:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.tmp")
        with open(staging, "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, path)  # readers see the old state or the new one, never half
        with contextlib.suppress(OSError):
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _load(self) -> None:
        path = self.state_path
        if path is None or not path.is_file():
            return
        state = torch.load(path, weights_only=True)
        s = self.settings
        self.shapes = state["shapes"]
        self.dtypes = {n: getattr(torch, d) for n, d in state["dtypes"].items()}
        self.fragments = []
        for saved in state["fragments"]:
            outer = OuterOptimizer(
                saved["outer"]["weights"],
                lr=s.outer_lr,
                momentum=s.outer_momentum,
                nesterov=s.nesterov,
            )
            outer.load_state_dict(saved["outer"])
            # this start's settings, not the saved ones
            outer.configure(lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov)
            self.fragments.append(Fragment(names=saved["names"], outer=outer, round=saved["round"]))
        self.rounds_closed = state["rounds_closed"]
        now = time.monotonic()  # the remembered members get a heartbeat timeout to come back
        self.members = {w: Member(w, float(i), now) for w, i in state["members"].items()}
        log.info("diloco: continuing from %s (rounds %s)", path, [f.round for f in self.fragments])

    # -- HTTP -----------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application serving this state."""
        from aiohttp import web

        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            if not self._authorized(request.headers.get("Authorization", "")):
                return _json(
                    {"error": "missing or wrong token: send 'Authorization: Bearer <token>'"},
                    401,
                )
            try:
                return await handler(request)
            except ProtocolError as err:
                return _json({"error": str(err)}, err.status)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                detail = f"; routes: {ROUTES}" if exc.status in (404, 405) else ""
                return _json({"error": f"{exc.reason}: {request.path[:200]}{detail}"}, exc.status)

        async def join(request: web.Request) -> web.Response:
            body = await self._read(request)
            return self._payload_response(self.join(body))

        async def sync(request: web.Request) -> web.Response:
            body = await self._read(request)
            return self._payload_response(await self.sync(body))

        async def heartbeat(request: web.Request) -> web.Response:
            return _json(self.heartbeat(await _json_body(request)))

        async def leave(request: web.Request) -> web.Response:
            return _json(self.leave(await _json_body(request)))

        async def status(request: web.Request) -> web.Response:
            return _json(self.status())

        app = web.Application(
            middlewares=[guard], client_max_size=self.settings.max_payload_mb * 2**20
        )
        app.router.add_post("/v1/join", join)
        app.router.add_post("/v1/sync", sync)
        app.router.add_post("/v1/heartbeat", heartbeat)
        app.router.add_post("/v1/leave", leave)
        app.router.add_get("/v1/status", status)
        app.on_startup.append(self._start_reaper)
        return app

    async def _read(self, request: web.Request) -> bytes:
        body = await request.read()
        self.bytes_received += len(body)
        return body

    def _payload_response(self, body: bytes) -> web.Response:
        from aiohttp import web

        self.bytes_sent += len(body)
        return web.Response(body=body, content_type=CONTENT_TYPE)

    async def _start_reaper(self, app: web.Application) -> None:
        async def reap() -> None:
            while True:
                await asyncio.sleep(_REAP_EVERY_S)
                try:
                    self.reap()
                except Exception:  # a bad round must not stop the reaper
                    log.exception("diloco: closing a round failed")

        run_while_serving(app, reap)

    def _authorized(self, header: str) -> bool:
        token = self.settings.token
        if token is None:
            return True
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "backslashreplace"), token.encode("ascii")
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        s = self.settings
        if s.certfile is None or s.keyfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(s.certfile, s.keyfile)
        return context


class ServerThread:
    """A :class:`DiLoCoServer` served from a background thread (tests, benchmarks)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.server = DiLoCoServer(settings)
        self.port: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="hookloop-diloco", daemon=True)

    @property
    def address(self) -> str:
        scheme = "https" if self.server.ssl_context() is not None else "http"
        return f"{scheme}://{self.server.settings.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the DiLoCo server did not start within {timeout:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"the DiLoCo server failed to start: {self._error}")
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as err:
            self._error = err
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with running(self.server) as port:
            self.port = port
            self._ready.set()
            await self._stop.wait()

    def stop(self, timeout: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout)


@contextlib.asynccontextmanager
async def running(server: DiLoCoServer):  # type: ignore[no-untyped-def]
    """Serve ``server`` on its host and port while the block runs; yields the bound port."""
    from aiohttp import web

    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    s = server.settings
    site = web.TCPSite(runner, s.host, s.port, ssl_context=server.ssl_context(), reuse_address=True)
    try:
        await site.start()
        port = _bound_port(runner) or s.port
        yield port
    finally:
        await runner.cleanup()


def _bound_port(runner: Any) -> int | None:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        for sock in getattr(server, "sockets", None) or []:
            return int(sock.getsockname()[1])
    return None


def _payload(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        return decode(body)
    except ValueError as err:
        raise ProtocolError(f"the request body must be a safetensors payload: {err}") from None


def _worker_id(meta: dict[str, Any]) -> str:
    worker_id = meta.get("worker_id")
    if not isinstance(worker_id, str) or not worker_id or len(worker_id) > 200:
        raise ProtocolError(f"worker_id must be a non-empty string, got {worker_id!r}")
    return worker_id


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        data = json.loads(await request.read())
    except ValueError:
        raise ProtocolError("the request body must be a JSON object") from None
    if not isinstance(data, dict):
        raise ProtocolError("the request body must be a JSON object")
    return data


def _json(data: Any, status: int = 200) -> web.Response:
    from aiohttp import web

    return web.json_response(data, status=status)
