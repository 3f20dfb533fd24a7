"""The control server's routes (the table is in :mod:`hookloop.control.server`), run on
the server's thread behind :mod:`hookloop.control.service`'s gate.

Nothing here touches the loop: status is read from a :class:`~hookloop.control.job.LiveJob`,
and a command only files requests on its Control.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hookloop.control.commands import COMMANDS, CommandError, client_of, parse_request
from hookloop.control.job import LiveJob
from hookloop.control.service import (
    Gate,
    HttpError,
    guarded,
    json_reply,
    read_body,
    run_while_serving,
)

if TYPE_CHECKING:
    from aiohttp import web

ROUTES = (
    "GET /, GET /jobs, GET /jobs/{job_id}/status, GET /jobs/{job_id}/history?after=SEQ, "
    "POST /jobs/{job_id}/control"
)
#: What ``GET /jobs`` tells a client without the token: the fields Forgather's client reads.
PUBLIC_JOB_FIELDS = ("job_id", "host", "port", "pid", "started_at")
#: How long the reply to a ``set`` waits for the loop to apply it (the end of the step).
SET_WAIT_S = 10.0
#: Largest request body read; bigger ones get 413 without being parsed.
MAX_BODY = 16 * 1024
#: What a request without the right token is told (401).
UNAUTHORIZED = (
    "missing or wrong bearer token; send the header 'Authorization: Bearer <token>' "
    "(`hookloop ctl JOB token` prints the token)"
)


def is_public(request: web.Request) -> bool:
    """The dashboard page, and ``GET /jobs`` sent without any ``Authorization`` header."""
    if request.method not in ("GET", "HEAD"):
        return False
    tokenless = "Authorization" not in request.headers
    return request.path == "/" or (request.path == "/jobs" and tokenless)


def refusal() -> web.Response:
    return json_reply({"error": UNAUTHORIZED}, 401, {"WWW-Authenticate": 'Bearer realm="hookloop"'})


def explain(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's error in one JSON line: its reason, the request, and the routes."""
    message = f"{exc.reason}: {request.method} {request.path[:200]}"
    if exc.status in (404, 405):
        message += f"; routes: {ROUTES}"
    allow = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return json_reply({"error": message}, exc.status, allow)


class ControlRoutes:
    """The handlers of one job's routes; ``jobs()`` lists every live job of this user."""

    def __init__(
        self,
        job: LiveJob,
        authorized: Callable[[str], bool],
        jobs: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self.job = job
        self.authorized = authorized
        self.jobs_listing = jobs

    def app(self) -> web.Application:
        """The aiohttp application, gated, with the step-rate sampler running beside it."""
        from aiohttp import web

        gate = Gate(
            name="control",
            error_prefix="control server error",
            authorized=self.authorized,
            public=is_public,
            refusal=refusal,
            explain=explain,
            reason_limit=300,
        )
        app = web.Application(middlewares=[guarded(gate)], client_max_size=MAX_BODY)
        app.router.add_get("/", self.page)
        app.router.add_get("/jobs", self.jobs)
        app.router.add_get("/jobs/{job_id}/status", self.status)
        app.router.add_get("/jobs/{job_id}/history", self.history)
        app.router.add_post("/jobs/{job_id}/control", self.control)
        app.on_startup.append(self.start_sampler)
        return app

    async def start_sampler(self, app: web.Application) -> None:
        async def sample() -> None:
            while True:
                self.job.sample_rate()
                await asyncio.sleep(1.0)

        run_while_serving(app, sample)

    def check_job(self, request: web.Request) -> None:
        """A 404 naming this server's job when the URL names another one."""
        asked = request.match_info.get("job_id", "")
        if asked != self.job.job_id:
            shown = asked if len(asked) <= 80 else asked[:77] + "..."
            raise HttpError(f"no job {shown!r} here; this server runs job {self.job.job_id!r}", 404)

    async def page(self, request: web.Request) -> web.Response:
        from aiohttp import web

        from hookloop.control.dashboard import CSP, PAGE

        return web.Response(body=PAGE, content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": CSP})  # fmt: skip

    async def jobs(self, request: web.Request) -> web.Response:
        listing = self.jobs_listing()
        if not self.authorized(request.headers.get("Authorization", "")):
            # Forgather's `control list --remote` sends no token: it gets where each
            # job listens, and nothing else (status and commands still need the token)
            listing = [{k: j.get(k) for k in PUBLIC_JOB_FIELDS} for j in listing]
        return json_reply({"jobs": listing})

    async def status(self, request: web.Request) -> web.Response:
        self.check_job(request)
        return json_reply(self.job.status())

    async def history(self, request: web.Request) -> web.Response:
        self.check_job(request)
        raw = request.query.get("after", "0")
        try:
            after = int(raw)
        except ValueError:
            raise HttpError(f"after must be an integer sequence number, got {raw[:40]!r}") from None
        records, last = self.job.snapshot.since(after)
        return json_reply({"job_id": self.job.job_id, "last_seq": last, "records": records})

    async def _set(self, values: dict[str, Any], client: str) -> dict[str, Any]:
        """File a ``set`` and wait (up to :data:`SET_WAIT_S`) for the loop to apply it at
        the end of the step: the reply says applied, or (409) refused and why, or, for a
        step slower than that, filed (``GET .../status`` lists it once applied)."""
        step, ident = self.job.file_set(values, client)
        settings = self.job.settings
        outcome = await asyncio.to_thread(settings.outcome, ident, SET_WAIT_S)
        if outcome is not None and outcome.get("at_step") is not None:
            message, step = (
                f"set {ident} scheduled for the end of step {outcome['at_step']}",
                (outcome["step"]),
            )
        elif outcome is not None and not outcome["applied"]:
            raise CommandError(f"set refused at step {outcome['step']}: {outcome['reason']}", 409)
        elif outcome is not None:
            message, step = f"set applied at the end of step {outcome['step']}", outcome["step"]
        else:
            message = (
                f"set filed at step {step}: not applied within {SET_WAIT_S:g} s (a slow "
                "step); GET .../status lists it under changes, or refused"
            )
        return {
            "status": "acknowledged",
            "command": "set",
            "timestamp": time.time(),
            "message": message,
            "accepted": "set",
            "job_id": self.job.job_id,
            "step": step,
            "id": ident,
            "applied": None if outcome is None else outcome["applied"],
        }

    async def control(self, request: web.Request) -> web.Response:
        self.check_job(request)
        body = await read_body(request)
        command, values = parse_request(body)
        client = client_of(body, request.headers.get("User-Agent", ""), request.remote)
        if command == "set":
            return json_reply(await self._set(values, client))
        step = self.job.file(command, values, client)
        if command == "status":
            message = f"status at step {step}: nothing to do (GET .../status reads it)"
        else:
            message = f"{command} filed at step {step}: the loop will {COMMANDS[command]}"
        return json_reply(
            {
                "status": "acknowledged",
                "command": command,
                "timestamp": time.time(),
                "message": message,
                "accepted": command,
                "job_id": self.job.job_id,
                "step": step,
            }
        )
