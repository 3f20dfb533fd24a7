"""The DiLoCo server's routes, Forgather's (``POST /register``, ``/submit_pseudograd``,
``/submit_fragment_pseudograd``, ``/heartbeat``, ``/deregister``, ``/control/{action}``;
``GET /status``, ``/global_params``, ``/dashboard`` and ``/``), behind the gate of
:mod:`hookloop.control.service`.

A route reads its body (JSON fields checked by :mod:`hookloop.diloco.fields`, tensors by
the server), calls one public method of the server, and writes its answer; what the
server refuses arrives here as an :class:`~hookloop.control.service.HttpError`.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hookloop.control.service import (
    Gate,
    HttpError,
    guarded,
    json_reply,
    one_line,
    read_body,
    read_json,
    run_while_serving,
)
from hookloop.diloco import fields
from hookloop.diloco.admin import CONTROL_ACTIONS
from hookloop.diloco.membership import SECRET_HEADER, Caller
from hookloop.diloco.wire import TENSOR_TYPE, save_tensors

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("hookloop.diloco")

ROUTES = (
    "POST /register, /submit_pseudograd, /submit_fragment_pseudograd, /heartbeat, /deregister, "
    f"/control/{{{','.join(CONTROL_ACTIONS)}}}; GET /status, /global_params, /dashboard"
)
#: What a request without the right token is told (401).
UNAUTHORIZED = "missing or wrong token: send 'Authorization: Bearer <token>'"


class Served(Protocol):
    """What the routes use of a :class:`~hookloop.diloco.server.DiLoCoServer`."""

    dashboard_enabled: bool
    max_payload_mb: int
    heartbeat_timeout: float

    def authorized(self, header: str) -> bool: ...
    def register(self, info: dict[str, Any], caller: Caller) -> dict[str, torch.Tensor]: ...
    def secret_of(self, worker_id: str) -> str: ...
    async def submit(self, body: bytes, caller: Caller) -> dict[str, torch.Tensor]: ...
    async def submit_fragment(self, body: bytes, caller: Caller) -> dict[str, torch.Tensor]: ...
    def heartbeat(self, data: dict[str, Any], caller: Caller) -> dict[str, Any]: ...
    def deregister(self, worker_id: str, caller: Caller) -> None: ...
    def control(self, action: str, data: dict[str, Any]) -> dict[str, Any]: ...
    def get_global_params(self) -> dict[str, torch.Tensor]: ...
    def status(self) -> dict[str, Any]: ...
    def evict_silent(self) -> list[str]: ...


def is_public(request: web.Request) -> bool:
    """The dashboard page holds no secret: a browser loads it, then the token is typed."""
    return request.method in ("GET", "HEAD") and request.path in ("/", "/dashboard")


def refusal() -> web.Response:
    return json_reply({"error": UNAUTHORIZED}, 401)


def explain(max_payload_mb: int, request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's error in Forgather's words (an unknown endpoint), or the body cap."""
    if exc.status == 413:
        return json_reply({"error": (
            f"the body is larger than the server's cap of {max_payload_mb} MB "
            "(hookloop diloco serve --max-payload-mb)")}, 413)  # fmt: skip
    detail = f"; routes: {ROUTES}" if exc.status in (404, 405) else ""
    return json_reply({"error": f"Unknown endpoint: {request.path[:200]}{detail}"}, exc.status)


def tensors(data: dict[str, torch.Tensor]) -> web.Response:
    from aiohttp import web

    return web.Response(body=save_tensors(data), content_type=TENSOR_TYPE)


def caller(request: web.Request) -> Caller:
    return Caller.from_request(request.headers, request.remote)


async def json_body(request: web.Request, route: str) -> dict[str, Any]:
    """The body's JSON object, each field ``route`` reads checked (400 naming the field)."""
    return await read_json(request, partial(fields.read_body, route))


class DiLoCoRoutes:
    """The handlers of a DiLoCo server's routes."""

    def __init__(self, server: Served) -> None:
        self.server = server

    def app(self) -> web.Application:
        """The aiohttp application, gated, with the health monitor running beside it."""
        from aiohttp import web

        server = self.server
        gate = Gate(
            name="diloco",
            error_prefix="DiLoCo server error",
            authorized=server.authorized,
            public=is_public,
            refusal=refusal,
            explain=partial(explain, server.max_payload_mb),
        )
        app = web.Application(
            middlewares=[guarded(gate)], client_max_size=server.max_payload_mb * 2**20
        )
        for route, handler in (
            ("/register", self.register),
            ("/submit_pseudograd", self.submit),
            ("/submit_fragment_pseudograd", self.submit_fragment),
            ("/heartbeat", self.heartbeat),
            ("/deregister", self.deregister),
            ("/control/{action}", self.control),
        ):
            app.router.add_post(route, handler)
            app.router.add_post(route + "/", handler)
        for route, handler in (("/global_params", self.global_params), ("/status", self.status),
                               ("/dashboard", self.dashboard), ("/", self.dashboard)):  # fmt: skip
            app.router.add_get(route, handler)
        app.on_startup.append(self.start_health_monitor)
        return app

    async def register(self, request: web.Request) -> web.Response:
        info = await json_body(request, "register")
        reply = tensors(self.server.register(info, caller(request)))
        reply.headers[SECRET_HEADER] = self.server.secret_of(info["worker_id"])
        return reply

    async def submit(self, request: web.Request) -> web.Response:
        return tensors(await self.server.submit(await read_body(request), caller(request)))

    async def submit_fragment(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        return tensors(await self.server.submit_fragment(body, caller(request)))

    async def heartbeat(self, request: web.Request) -> web.Response:
        data = await json_body(request, "heartbeat")
        try:
            return json_reply(self.server.heartbeat(data, caller(request)))
        except HttpError:
            raise
        except ValueError as err:
            raise HttpError(str(err)) from None

    async def deregister(self, request: web.Request) -> web.Response:
        data = await json_body(request, "deregister")
        self.server.deregister(data["worker_id"], caller(request))
        return json_reply({"status": "ok"})

    async def control(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        return json_reply(self.server.control(action, await json_body(request, action)))

    async def global_params(self, request: web.Request) -> web.Response:
        return tensors(self.server.get_global_params())

    async def status(self, request: web.Request) -> web.Response:
        return json_reply(self.server.status())

    async def dashboard(self, request: web.Request) -> web.Response:
        from aiohttp import web

        if not self.server.dashboard_enabled:
            return json_reply({"error": "Dashboard disabled"}, 404)
        from hookloop.diloco.dashboard import CSP, PAGE

        return web.Response(body=PAGE, content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": CSP})  # fmt: skip

    async def start_health_monitor(self, app: web.Application) -> None:
        """Evict workers silent for ``heartbeat_timeout`` (checked three times as often)."""
        timeout = self.server.heartbeat_timeout
        if timeout <= 0:
            return
        period = min(timeout / 3, 30.0)

        async def monitor() -> None:
            while True:
                await asyncio.sleep(period)
                try:
                    self.server.evict_silent()
                except Exception as err:  # the monitor must outlive one bad eviction
                    log.error("diloco: evicting silent workers failed: %s", one_line(err))

        run_while_serving(app, monitor)
