"""What hookloop's two HTTP servers share: the control server
(:mod:`hookloop.control.server`) and the DiLoCo server (:mod:`hookloop.diloco.server`).

A server describes its door with a :class:`Gate` and puts :func:`guarded` in front of
its routes. The middleware then, for every request:

- lets a public route through, and answers anything else without the right bearer token
  with the server's own 401 (:func:`bearer_matches` compares in constant time);
- answers an :class:`HttpError` a route raises with its status and ``{"error": ...}`` in
  one line, aiohttp's own errors (404, 405, 413) as the server explains them, and any
  other failure with a logged one-line 500, never aiohttp's HTML page;
- adds :data:`SAFE_HEADERS` and, unless the response has its own, :data:`API_CSP`.

A route reads its body with :func:`read_body` (a declared length beyond the app's
``client_max_size`` is answered 413 before a byte is read) and its JSON with
:func:`read_json` (anything malformed is a one-line 400). :class:`Serving` runs the
app on its own asyncio loop, in a daemon thread or in the caller's, until stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hookloop.control.bodies import BodyError

if TYPE_CHECKING:
    import ssl

    from aiohttp import web

log = logging.getLogger("hookloop.control")

#: On every response: nothing cached, sniffed, framed, or sent on as a Referer.
SAFE_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
#: The policy of every response that is not a page: nothing may load or run.
API_CSP = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


class HttpError(ValueError):
    """A request a route refuses: answered with ``status`` and :meth:`reply` as JSON."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def reply(self) -> dict[str, Any]:
        """The JSON body of the answer."""
        return {"error": str(self)}


def one_line(err: BaseException, limit: int = 500) -> str:
    """``err`` as one line of at most ``limit`` characters (its type when it says nothing)."""
    return " ".join(str(err).split())[:limit] or type(err).__name__


def json_reply(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """``data`` as an ``application/json`` response (no NaN: JavaScript cannot read it)."""
    from aiohttp import web

    return web.Response(
        text=json.dumps(data, allow_nan=False, default=str),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def secure(response: web.StreamResponse) -> web.StreamResponse:
    """``response`` with :data:`SAFE_HEADERS`, and :data:`API_CSP` unless it has a policy."""
    response.headers.update(SAFE_HEADERS)
    response.headers.setdefault("Content-Security-Policy", API_CSP)
    return response


def bearer_matches(header: str, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>``, compared in constant
    time (as bytes, so that a non-ASCII header is a mismatch, not an error)."""
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8", "backslashreplace"), token.encode("ascii")
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def read_body(request: web.Request) -> bytes:
    """The request's body; one that declares more than the app's ``client_max_size`` is
    refused (413) before it is read, one that turns out longer while read (no length
    declared) as soon as it passes the cap."""
    from aiohttp import web

    declared = request.content_length
    if declared is not None and declared > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(request.client_max_size)
    return await request.read()


async def read_json(request: web.Request, parse: Callable[[bytes], Any]) -> Any:
    """The body as ``parse`` reads it; a :class:`BodyError` it raises is a one-line 400."""
    body = await read_body(request)
    try:
        return parse(body)
    except BodyError as err:
        raise HttpError(str(err)) from None


@dataclass(frozen=True)
class Gate:
    """How one server answers what its routes do not: who may pass, and in whose words."""

    #: Names the server in its log lines ("control: GET /x failed: ...").
    name: str
    #: The first words of a 500's message ("control server error").
    error_prefix: str
    #: Whether an ``Authorization`` header (``""`` when absent) lets a request through.
    authorized: Callable[[str], bool]
    #: Whether a request needs no token at all (a page, a public listing).
    public: Callable[[web.Request], bool]
    #: The answer to a request without the right token (401).
    refusal: Callable[[], web.Response]
    #: The answer to aiohttp's own error (no route, wrong method, body too large).
    explain: Callable[[web.Request, web.HTTPException], web.Response]
    #: The longest reason a 500 quotes.
    reason_limit: int = 500

    async def answer(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The response to ``request``: refused, explained, or the handler's."""
        from aiohttp import web

        try:
            if not self.public(request) and not self.authorized(
                request.headers.get("Authorization", "")
            ):
                return self.refusal()
            return await handler(request)
        except HttpError as err:
            return json_reply(err.reply(), err.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self.explain(request, exc)
        except Exception as err:  # one JSON line, never aiohttp's own (HTML) error page
            reason = one_line(err, self.reason_limit)
            log.error("%s: %s %s failed: %s", self.name, request.method, request.path[:200],
                      reason)  # fmt: skip
            return json_reply({"error": f"{self.error_prefix}: {reason}"}, 500)


def guarded(gate: Gate) -> Any:
    """The aiohttp middleware that puts ``gate`` and :func:`secure` before every route."""
    from aiohttp import web

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        return secure(await gate.answer(request, handler))

    return guard


def run_while_serving(app: web.Application, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Start ``job()`` on the running loop and cancel it when ``app`` is cleaned up.

    Call it from an ``on_startup`` handler; ``job`` is a loop that never returns by
    itself (a sampler, a reaper)."""
    task = asyncio.get_running_loop().create_task(job())

    async def cancel(_app: web.Application) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.on_cleanup.append(cancel)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the kernel picks a free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"cannot resolve host {host!r}: {err}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


@dataclass(frozen=True)
class Address:
    """Where an app listens: a socket bound beforehand (:func:`listen`), or ``host:port``
    bound when serving starts, as aiohttp binds it (every address ``host`` names)."""

    sock: socket.socket | None = None
    host: str = "127.0.0.1"
    port: int = 0
    ssl_context: ssl.SSLContext | None = None

    def site(self, runner: web.AppRunner) -> web.BaseSite:
        from aiohttp import web

        if self.sock is not None:
            return web.SockSite(runner, self.sock, ssl_context=self.ssl_context)
        return web.TCPSite(runner, self.host, self.port, ssl_context=self.ssl_context,
                           reuse_address=True)  # fmt: skip


class Serving:
    """One aiohttp app served on an asyncio loop until :meth:`request_stop`: in a daemon
    thread (:meth:`start`) or in the caller's (``await serve(...)``)."""

    def __init__(self, name: str) -> None:
        self.name = name  # "control", "DiLoCo": in messages and the thread's name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None
        self.thread: threading.Thread | None = None
        self.port: int | None = None  # the port it listens on, once it does

    async def serve(
        self, app: web.Application, where: Address, ready: Callable[[], None] | None = None
    ) -> None:
        """Serve ``app`` at ``where`` until :meth:`request_stop`; ``ready()`` once listening."""
        from aiohttp import web

        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        try:
            await runner.setup()
            try:
                await where.site(runner).start()
                addresses = runner.addresses
                self.port = int(addresses[0][1]) if addresses else where.port
                if ready is not None:
                    ready()
                await self.stopping.wait()
                if where.sock is not None:
                    # Stop accepting before anything closes, and let connections accepted
                    # a moment ago finish their set-up: asyncio (3.11) drops, without
                    # closing it, a connection whose set-up finds its server already
                    # closed, and the client then hangs until it times out.
                    self.loop.remove_reader(where.sock.fileno())
                    await asyncio.sleep(0.05)
            finally:
                await runner.cleanup()
        finally:
            if where.sock is not None:
                where.sock.close()

    def start(
        self, main: Callable[[Callable[[], None]], Coroutine[Any, Any, None]], timeout: float = 15.0
    ) -> None:
        """Run ``main(ready)`` on a new loop in a daemon thread; return once it calls
        ``ready()``, or raise what it raised before."""
        ready, failed = threading.Event(), []

        def run() -> None:
            try:
                asyncio.run(main(ready.set))
            except BaseException as err:  # handed to start(), or logged once serving
                if ready.is_set():
                    log.warning("hookloop %s server stopped: %r", self.name, err)
                failed.append(err)
                ready.set()

        self.thread = threading.Thread(
            target=run, name=f"hookloop-{self.name.lower()}", daemon=True
        )
        self.thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"the {self.name} server did not start within {timeout:.0f} s")
        if failed:
            raise failed[0]

    def request_stop(self) -> None:
        """Ask the loop to stop serving (from any thread or a signal handler); returns at once."""
        loop, stopping = self.loop, self.stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and wait for the thread (unless this is it)."""
        self.request_stop()
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            log.warning("hookloop %s server thread did not stop within %.0f s", self.name, timeout)
