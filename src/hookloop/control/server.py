"""The control server: see and steer a running job over authenticated HTTP.

:class:`ControlServer` (Forgather's name: ``TrainerControlCallback``) starts an
aiohttp server in a background thread on rank 0 when training starts and
stops it when training ends. It never touches the loop's state: a command only
files a request on ``ctx.control`` (thread-safe), and the loop acts on it at
the end of the step in progress, on every rank alike (the loop agrees control
requests across ranks).

Routes (each needs ``Authorization: Bearer <token>`` unless said otherwise):

==========================  =====================================================
``GET  /``                  the live dashboard (a self-contained page, no secrets;
                            no token)
``GET  /jobs``              ``{"jobs": [...]}``: every live job of this user; without
                            an ``Authorization`` header only where each listens
                            (job_id, host, port, pid, started_at), for Forgather's
                            ``control list --remote``
``GET  /jobs/{id}/status``  step, epoch, max_steps, latest metrics, rate, ETA ...
``GET  /jobs/{id}/history`` logged metrics since ``?after=<seq>`` (for charts)
``POST /jobs/{id}/control`` ``{"command": "graceful_stop" | "save_checkpoint" |
                            "save_and_stop" | "abort" | "evaluate_now" | "status",
                            "values": {...}}`` (values: for a command that takes them;
                            Forgather's clients call them ``"data"``)
==========================  =====================================================

Replies speak Forgather's protocol and hookloop's at once. A status carries
Forgather's ``global_step``, ``status`` (``running`` while the job trains) and the
latest log's keys at the top level, beside hookloop's ``step``, ``phase`` and
nested ``metrics``. A command is answered ``200`` with Forgather's
``{"status": "acknowledged", "command", "timestamp", "message"}`` plus
hookloop's ``accepted``, ``job_id`` and ``step``, once filed. A malformed body or an
unknown command gets ``400`` with the list of valid commands, and so does a value no
field takes (NaN, an integer beyond ``±2**53``, an over-long string:
:mod:`hookloop.control.bodies`), naming its field; a command the job cannot carry out
(saving without an output directory, evaluating without evaluation data, anything once
a stop has been filed) gets ``409``. Nothing a
client sends reaches the training thread except the requests a command files
(:data:`SERVER_COMMANDS`; :func:`register_command` adds one, with the values it takes).
Every response carries a Content-Security-Policy and ``nosniff``
(:mod:`hookloop.control.pages`); an unexpected failure is one JSON line, ``500``.

What the status shows is cheap to keep: the training thread does no work per
step for it. Step, epoch and sample counters are plain integers the server
thread reads straight from ``TrainState`` (a single attribute read is atomic);
metrics are copied into a small lock-protected snapshot only at ``on_log`` and
``on_eval_end``; the step rate is sampled by the server thread once a second.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookloop.callback import Callback
from hookloop.control.background import run_while_serving
from hookloop.control.bodies import BodyError, check_tree, text
from hookloop.control.pages import secure
from hookloop.control.registry import (
    JobDir,
    JobRecord,
    check_job_id,
    new_job_id,
    registries,
)
from hookloop.processes import process_start_ticks
from hookloop.profile import current_profile

if TYPE_CHECKING:
    from aiohttp import web

    from hookloop.state import CallbackContext, Control, TrainState

log = logging.getLogger("hookloop.control")


@dataclass(frozen=True)
class Command:
    """One command of ``POST /jobs/{id}/control``: what it files on the loop's Control.

    ``requests(values)`` returns the requests to file, each ``(kind, values)`` of the
    request vocabulary (:mod:`hookloop.requests`), filed together. ``takes`` names the
    values the command reads from the body's ``"values"`` object (none: it takes none)
    and ``check(values)`` refuses bad ones with a :class:`CommandError`. ``needs`` is
    what the job must have (``"checkpoints"``, ``"eval data"``); ``ends``: the job
    is ending once it is filed (no command is taken after it). A command that files
    nothing (``status``) is acknowledged in any phase.
    """

    doc: str
    requests: Callable[[dict[str, Any]], list[tuple[str, dict[str, Any]]]]
    takes: tuple[str, ...] = ()
    check: Callable[[dict[str, Any]], None] | None = None
    needs: str | None = None
    ends: bool = False
    #: The command takes any keys (``set``: the job checks them against what it can change).
    any_values: bool = False


#: Every command the server takes, by name (:func:`register_command` adds one).
SERVER_COMMANDS: dict[str, Command] = {
    "graceful_stop": Command(
        "finish the current step, save a checkpoint (when the job has an output directory) "
        "and exit 0",
        lambda v: [("stop", {"reason": "graceful_stop requested over HTTP"})],
        ends=True,
    ),
    "save_checkpoint": Command(
        "write a checkpoint at the end of the current step and go on",
        lambda v: [("save", {})],
        needs="checkpoints",
    ),
    "save_and_stop": Command(
        "write a checkpoint at the end of the current step, then exit 0",
        lambda v: [("save", {}), ("stop", {"reason": "save_and_stop requested over HTTP"})],
        needs="checkpoints",
        ends=True,
    ),
    "abort": Command(
        "end after the current step without saving anything (exit code 3)",
        lambda v: [("abort", {"reason": "abort requested over HTTP"})],
        ends=True,
    ),
    "evaluate_now": Command(
        "run an evaluation at the end of the current step and go on",
        lambda v: [("evaluate", {})],
        needs="eval data",
    ),
    "set": Command(
        "change live settings (lr, lr_scale, weight_decay, clip_grad_norm, log_every, ...) "
        "at the end of the current step, on every rank, recorded and replayed on resume",
        lambda v: [("set", v)],
        needs="live settings",
        any_values=True,
    ),
    # Forgather's clients may post it; it changes nothing (GET .../status reads the status)
    "status": Command("change nothing: acknowledge (GET /jobs/{id}/status reads it)", lambda v: []),
}
#: The commands ``POST /jobs/{id}/control`` accepts, with what each does.
COMMANDS: dict[str, str] = {name: c.doc for name, c in SERVER_COMMANDS.items()}


def register_command(name: str, command: Command) -> None:
    """Let the server take ``name``: a new command, typically filing a request kind added
    with :func:`hookloop.requests.register_kind` (its handler: ``register_action``)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a command name must be an identifier, got {name!r}")
    if name in SERVER_COMMANDS and SERVER_COMMANDS[name] != command:
        raise ValueError(f"command {name!r} is already registered")
    SERVER_COMMANDS[name] = command
    COMMANDS[name] = command.doc


ROUTES = (
    "GET /, GET /jobs, GET /jobs/{job_id}/status, GET /jobs/{job_id}/history?after=SEQ, "
    "POST /jobs/{job_id}/control"
)
#: What ``GET /jobs`` tells a client without the token: the fields Forgather's client reads.
PUBLIC_JOB_FIELDS = ("job_id", "host", "port", "pid", "started_at")
#: Largest request body read; bigger ones get 413 without being parsed.
MAX_BODY = 16 * 1024
#: Logged records kept for the dashboard's charts.
HISTORY_LEN = 5000
_RATE_WINDOW_S = 30.0
_BODY_HELP = 'send a JSON object such as {"command": "graceful_stop"}'


class CommandError(ValueError):
    """A control request that cannot be carried out; ``status`` is its HTTP code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_command(body: bytes) -> str:
    """The command named by a request body, or :class:`CommandError` saying what is wrong."""
    return parse_request(body)[0]


def parse_request(body: bytes) -> tuple[str, dict[str, Any]]:
    """``(command, values)`` from a request body ``{"command": ..., "values": {...}}``, the
    values checked against what the command takes; :class:`CommandError` otherwise."""
    valid = ", ".join(COMMANDS)
    if not body.strip():
        raise CommandError(f"empty request body; {_BODY_HELP}. Valid commands: {valid}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # includes UnicodeDecodeError and JSONDecodeError
        raise CommandError(
            f"the request body is not valid JSON; {_BODY_HELP}. Valid commands: {valid}"
        ) from None
    if not isinstance(data, dict):
        raise CommandError(
            f"the request body must be a JSON object, got {type(data).__name__}; {_BODY_HELP}. "
            f"Valid commands: {valid}"
        )
    try:  # no NaN, huge integer, long string or deep nesting anywhere, a printable client
        check_tree(data)
        if "client" in data:
            text("client", data["client"])
    except BodyError as err:
        raise CommandError(str(err)) from None
    if "command" not in data:
        raise CommandError(f'missing "command"; valid commands: {valid}')
    command = data["command"]
    if not isinstance(command, str) or command not in SERVER_COMMANDS:
        shown = repr(command) if len(repr(command)) <= 60 else repr(command)[:57] + "..."
        raise CommandError(f"unknown command {shown}; valid commands: {valid}")
    key = "values"
    if "data" in data:  # Forgather's clients send {"command", "data": {}}
        if "values" in data:
            raise CommandError('send the command\'s values as "values" or as "data", not both')
        key = "data"
    return command, _values(command, data.get(key), key)


def _values(command: str, values: Any, key: str = "values") -> dict[str, Any]:
    spec = SERVER_COMMANDS[command]
    if values is None or (values == {} and not spec.takes):
        values = {}
    elif not isinstance(values, dict):
        raise CommandError(f'"{key}" must be a JSON object, got {type(values).__name__}')
    unknown = sorted(set(values) - set(spec.takes))
    if unknown and not spec.any_values:
        takes = ", ".join(spec.takes) if spec.takes else "none"
        raise CommandError(f"{command} takes no value {unknown[0]!r}; it takes: {takes}")
    if spec.any_values and not values:
        raise CommandError(f'{command} needs at least one value in "{key}", e.g. {{"lr": 3e-4}}')
    missing = [k for k in spec.takes if k not in values]
    if missing:
        raise CommandError(f'{command} needs the value {missing[0]!r} in "values"')
    if spec.check is not None:
        spec.check(values)
    return values


def client_of(body: bytes, user_agent: str, remote: str | None) -> str:
    """Who sent a command, for the record of a change: the body's ``"client"`` (printable,
    cut to 80 characters) or the User-Agent, and the address it came from."""
    named: Any = None
    with contextlib.suppress(ValueError, RecursionError, AttributeError):
        named = json.loads(body).get("client")
    text = named if isinstance(named, str) and named.strip() else user_agent or "unknown"
    text = "".join(ch for ch in text if ch.isprintable())[:80] or "unknown"
    return f"{text} ({remote})" if remote else text


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _finite(value: Any) -> Any:
    """JSON-safe number: NaN/Inf become strings (JavaScript's JSON.parse rejects them)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else str(number)


def _numbers(values: dict[str, Any] | None) -> dict[str, Any]:
    if not values:
        return {}
    return {str(k): _finite(v) for k, v in values.items()}


class _Snapshot:
    """What the training thread publishes for the server thread, behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.phase = "starting"
        self.started = time.time()
        self.logs: dict[str, Any] = {}
        self.logs_step: int | None = None
        self.eval: dict[str, Any] = {}
        self.eval_step: int | None = None
        self.checkpoint: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LEN)
        self.seq = 0
        self.filed: deque[dict[str, Any]] = deque(maxlen=20)
        self.stopping: str | None = None  # the stop/abort command already filed
        self.rate_samples: deque[tuple[float, int]] = deque()

    def record(self, kind: str, step: int, values: dict[str, Any]) -> None:
        with self.lock:
            self.seq += 1
            entry = {"seq": self.seq, "kind": kind, "step": step, "time": time.time()}
            entry.update(values)
            self.history.append(entry)
            if kind == "train":
                self.logs, self.logs_step = values, step
            else:
                self.eval, self.eval_step = values, step

    def since(self, after: int) -> tuple[list[dict[str, Any]], int]:
        with self.lock:
            if after >= self.seq:
                return [], self.seq
            return [r for r in self.history if r["seq"] > after], self.seq

    def sample_rate(self, now: float, step: int) -> None:
        samples = self.rate_samples
        samples.append((now, step))
        while len(samples) > 2 and now - samples[0][0] > _RATE_WINDOW_S:
            samples.popleft()

    def steps_per_second(self, now: float, step: int) -> float | None:
        samples = list(self.rate_samples)
        if not samples:
            return None
        t0, s0 = samples[0]
        if step < s0:  # counters went back (a resume inside the same process)
            return None
        return (step - s0) / (now - t0) if now - t0 >= 1.0 else None


class ControlServer(Callback):
    """Serve status, commands and a dashboard for this job over authenticated HTTP.

    ``host`` defaults to loopback; any other address draws a warning, because
    the token then travels over the network in clear text. ``port=0`` (or None)
    picks a free port. ``auth_token`` defaults to a fresh
    ``secrets.token_urlsafe(32)``; any printable ASCII token without spaces is taken,
    short ones too, as Forgather takes them. ``jobs_dir`` names the one registry the
    job announces itself in (default: hookloop's and Forgather's, see
    :mod:`hookloop.control.registry`).
    When the server cannot start (aiohttp missing, port taken, directory not
    private) training goes on without it after a warning, unless
    ``required=True``. ``announce`` prints the URL and how to get the token.

    The parameters are Forgather's, in its order: ``enable_http=None`` serves
    when aiohttp is installed (and warns, naming the extra, when it is not).
    ``disable_auth=True`` serves without a token (a
    loud warning at start); on an address other than loopback it is refused
    unless ``allow_remote_without_auth=True`` says so as well (Forgather only
    warns). Only rank 0 serves; the loop agrees the requests it files across ranks.
    """

    priority = 100  # reads logs after every producer has written them

    def __init__(
        self,
        job_id: str | None = None,
        port: int | None = None,
        enable_http: bool | None = None,
        host: str | None = None,
        auth_token: str | None = None,
        disable_auth: bool = False,
        *,
        allow_remote_without_auth: bool = False,
        jobs_dir: str | Path | None = None,
        announce: bool = True,
        required: bool = False,
    ) -> None:
        if job_id is not None:
            check_job_id(job_id)
        port = 0 if port is None else port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(
                f"port must be an int in [0, 65535] (0: pick a free one), got {port!r}"
            )
        host = "127.0.0.1" if host is None else host
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be an address to bind, e.g. '127.0.0.1', got {host!r}")
        if auth_token == "":  # Forgather: an empty token means "make one"
            auth_token = None
        if auth_token is not None and (
            not isinstance(auth_token, str)
            or not auth_token.isascii()
            or not auth_token.isprintable()
            or " " in auth_token
            or len(auth_token) > 4096
        ):
            shown = repr(auth_token) if not isinstance(auth_token, str) else "that string"
            raise ValueError(
                "auth_token must be a string of printable ASCII without spaces, at most 4096 "
                f"characters (or None or '' for a fresh random one), got {shown}"
            )
        for name, flag in (
            ("disable_auth", disable_auth),
            ("allow_remote_without_auth", allow_remote_without_auth),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if enable_http is not None and not isinstance(enable_http, bool):
            raise ValueError(
                f"enable_http must be True, False or None (serve when aiohttp is installed), "
                f"got {enable_http!r}"
            )
        if disable_auth and not is_loopback(host) and not allow_remote_without_auth:
            raise ValueError(
                f"disable_auth=True on host {host!r} would let anyone who reaches it stop or "
                "abort the job: bind to 127.0.0.1, keep authentication, or also pass "
                "allow_remote_without_auth=True"
            )
        if enable_http is None:  # Forgather's "when aiohttp is installed": without it the
            enable_http = True  # start fails with a warning naming the extra, training goes on
        self.job_id = job_id or new_job_id()
        self.host = host
        self.port = port
        self.enable_http = enable_http
        self.disable_auth = disable_auth
        self.allow_remote_without_auth = allow_remote_without_auth
        self._fixed_token = auth_token
        self.token: str | None = None
        self.jobs_dir = jobs_dir
        self.announce = announce
        self.required = required
        self.url: str | None = None
        self.job_dir: JobDir | None = None
        self._mirrors: list[JobDir] = []
        self._state: TrainState | None = None
        self._control: Control | None = None
        self._snapshot = _Snapshot()
        self._thread: _ServerThread | None = None
        self._record: JobRecord | None = None
        self._can_save = False
        self._can_evaluate = False
        self._user_state: dict[str, Any] = {}
        self._live: Any = None  # the loop's LiveSettings (hookloop.loop.live)

    # -- events (training thread) ----------------------------------------------
    def on_train_start(self, ctx: CallbackContext) -> None:
        if not self.enable_http or not ctx.state.is_rank_zero or self._thread is not None:
            return
        self._state, self._control = ctx.state, ctx.control
        self._user_state = ctx.user_state  # what other callbacks publish (e.g. stragglers)
        self._can_save = ctx.run.can_checkpoint
        self._can_evaluate = ctx.run.has_eval_data
        self._live = ctx.settings
        self._snapshot = _Snapshot()
        try:
            self._start(ctx)
        except Exception as err:
            self._stop_server()
            if self.required:
                raise
            message = f"hookloop: control server not started: {err}; training goes on without it"
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def on_log(self, ctx: CallbackContext) -> None:
        if self._thread is not None:
            self._snapshot.record("train", ctx.state.step, _numbers(ctx.logs))

    def on_eval_start(self, ctx: CallbackContext) -> None:
        if self._thread is not None:
            self._snapshot.phase = "evaluating"

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if self._thread is not None:
            self._snapshot.record("eval", ctx.state.step, _numbers(ctx.metrics))
            self._snapshot.phase = "training"

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        if self._thread is not None:
            with self._snapshot.lock:
                self._snapshot.checkpoint = {
                    "step": ctx.state.step,
                    "path": str(ctx.checkpoint_path),
                }

    def on_train_end(self, ctx: CallbackContext) -> None:
        self._snapshot.phase = "finished"
        self._stop_server()

    def on_exception(self, ctx: CallbackContext) -> None:
        self._snapshot.phase = "failed"
        self._stop_server()

    # -- start and stop -----------------------------------------------------------
    def _start(self, ctx: CallbackContext) -> None:
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "the control server needs aiohttp: pip install 'hookloop[control]'"
            ) from None
        if not is_loopback(self.host):
            message = (
                f"hookloop: the control server binds to {self.host}, reachable from other "
                "machines; the bearer token travels unencrypted over plain HTTP. Bind to "
                "127.0.0.1 and use an SSH tunnel unless this network is trusted."
            )
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        if self.disable_auth:
            message = (
                f"hookloop: the control server of job {self.job_id} runs WITHOUT AUTHENTICATION "
                f"(disable_auth=True): anyone who can reach {self.host} can stop, abort or "
                "save this job"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            print(message, file=sys.stderr, flush=True)
        sock = _bind(self.host, self.port)
        try:
            self.token = (
                None if self.disable_auth else self._fixed_token or secrets.token_urlsafe(32)
            )
            self.job_dir = JobDir(self.job_id, self.jobs_dir)
            self.job_dir.create()
            if self.token is not None:
                self.job_dir.write_token(self.token)
            self._mirrors = self._announce_in_forgather()
            atexit.register(self._atexit)
            bound_host, bound_port = sock.getsockname()[:2]
            self.url = _base_url(bound_host, bound_port)
            self._thread = _ServerThread(self._make_app(), sock)
        except BaseException:
            sock.close()
            raise
        self._snapshot.phase = "training"  # before anyone can find the endpoint
        self._thread.start()
        run_dir = ctx.run.dir
        self._record = JobRecord(
            job_id=self.job_id,
            pid=os.getpid(),
            url=self.url,
            host=bound_host,
            port=bound_port,
            started=time.time(),
            out_dir=str(run_dir.root.resolve()) if run_dir is not None else None,
            recipe=getattr(ctx.config, "recipe", None),
            pid_start=process_start_ticks(os.getpid()),
            hookloop=_version(),
            logging_dir=str(run_dir.root.resolve()) if run_dir is not None else None,
            auth_disabled=self.disable_auth,
            dir=self.job_dir.path,
        )
        self.job_dir.write_endpoint(self._record)
        for mirror in self._mirrors:
            try:
                mirror.write_endpoint(self._record)
            except Exception as err:
                self._mirror_failed(mirror, err)
        if self.announce:
            print(
                f"hookloop: control server {self.url} (job {self.job_id}); token: "
                f"`hookloop ctl {self.job_id} token` or the file {self.job_dir.token_path}",
                file=sys.stderr,
                flush=True,
            )

    def _announce_in_forgather(self) -> list[JobDir]:
        """Directories for this job in Forgather's registries, with the token (none when
        a registry was named explicitly); one that cannot be made is skipped with a warning."""
        mirrors = []
        for base in registries(self.jobs_dir)[1:]:
            mirror = JobDir(self.job_id, base)
            try:
                mirror.create()
                if self.token is not None:
                    mirror.write_token(self.token)
            except Exception as err:
                self._mirror_failed(mirror, err)
                continue
            mirrors.append(mirror)
        return mirrors

    @staticmethod
    def _mirror_failed(mirror: JobDir, err: Exception) -> None:
        mirror.remove()
        message = (
            f"hookloop: job not announced in Forgather's registry {mirror.base} ({err}); "
            "Forgather's client will not list it"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _stop_server(self) -> None:
        self._record = None
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()
        self._remove_dirs()
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)

    def _remove_dirs(self) -> None:
        for mirror in self._mirrors:
            mirror.remove()
        self._mirrors = []
        if self.job_dir is not None:
            self.job_dir.remove()

    def _atexit(self) -> None:
        """Best effort at interpreter exit (e.g. train() never reached its end)."""
        self._remove_dirs()

    @property
    def record(self) -> JobRecord | None:
        """What ``endpoint.json`` says, while the server is up (None otherwise)."""
        return self._record

    def close(self) -> None:
        """Stop serving and remove the job directory (also done at train end)."""
        self._stop_server()

    # -- requests (server thread) --------------------------------------------------
    def _make_app(self) -> web.Application:
        from aiohttp import web

        from hookloop.control.dashboard import CSP, PAGE

        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                header = request.headers.get("Authorization")
                public = request.method in ("GET", "HEAD") and (
                    request.path == "/" or (request.path == "/jobs" and header is None)
                )
                if not public and not self._authorized(header or ""):
                    response = _json(
                        {
                            "error": "missing or wrong bearer token; send the header "
                            "'Authorization: Bearer <token>' (`hookloop ctl JOB token` "
                            "prints the token)"
                        },
                        401,
                        {"WWW-Authenticate": 'Bearer realm="hookloop"'},
                    )
                else:
                    response = await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                message = f"{exc.reason}: {request.method} {request.path[:200]}"
                if exc.status in (404, 405):
                    message += f"; routes: {ROUTES}"
                allow = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
                response = _json({"error": message}, exc.status, allow)
            except Exception as err:  # one JSON line, never aiohttp's own (HTML) error page
                reason = " ".join(str(err).split())[:300] or type(err).__name__
                log.error("control: %s %s failed: %s", request.method, request.path[:200], reason)
                response = _json({"error": f"control server error: {reason}"}, 500)
            return secure(response)

        async def page(request: web.Request) -> web.Response:
            return web.Response(
                body=PAGE,
                content_type="text/html",
                charset="utf-8",
                headers={"Content-Security-Policy": CSP},
            )

        async def jobs(request: web.Request) -> web.Response:
            listing = self._jobs()
            if not self._authorized(request.headers.get("Authorization", "")):
                # Forgather's `control list --remote` sends no token: it gets where each
                # job listens, and nothing else (status and commands still need the token)
                listing = [{k: j.get(k) for k in PUBLIC_JOB_FIELDS} for j in listing]
            return _json({"jobs": listing})

        async def status(request: web.Request) -> web.Response:
            return self._wrong_job(request) or _json(self._status())

        async def history(request: web.Request) -> web.Response:
            wrong = self._wrong_job(request)
            if wrong is not None:
                return wrong
            raw = request.query.get("after", "0")
            try:
                after = int(raw)
            except ValueError:
                return _json(
                    {"error": f"after must be an integer sequence number, got {raw[:40]!r}"}, 400
                )
            records, last = self._snapshot.since(after)
            return _json({"job_id": self.job_id, "last_seq": last, "records": records})

        async def control(request: web.Request) -> web.Response:
            wrong = self._wrong_job(request)
            if wrong is not None:
                return wrong
            body = await request.read()
            try:
                command, values = parse_request(body)
                client = client_of(body, request.headers.get("User-Agent", ""), request.remote)
                step = self._file(command, values, client)
            except CommandError as err:
                return _json({"error": str(err), "valid_commands": list(COMMANDS)}, err.status)
            return _json(
                {
                    "status": "acknowledged",
                    "command": command,
                    "timestamp": time.time(),
                    "message": (
                        f"{command} filed at step {step}: the loop will {COMMANDS[command]}"
                        if command != "status"
                        else f"status at step {step}: nothing to do (GET .../status reads it)"
                    ),
                    "accepted": command,
                    "job_id": self.job_id,
                    "step": step,
                }
            )

        app = web.Application(middlewares=[guard], client_max_size=MAX_BODY)
        app.router.add_get("/", page)
        app.router.add_get("/jobs", jobs)
        app.router.add_get("/jobs/{job_id}/status", status)
        app.router.add_get("/jobs/{job_id}/history", history)
        app.router.add_post("/jobs/{job_id}/control", control)
        app.on_startup.append(self._start_sampler)
        return app

    async def _start_sampler(self, app: web.Application) -> None:
        async def sample() -> None:
            while True:
                state = self._state
                if state is not None:
                    self._snapshot.sample_rate(time.monotonic(), state.step)
                await asyncio.sleep(1.0)

        run_while_serving(app, sample)

    def _authorized(self, header: str) -> bool:
        if self.disable_auth:
            return True
        token = self.token
        if token is None:
            return False
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # bytes, so that a non-ASCII header is just a mismatch (str needs ASCII here)
        return hmac.compare_digest(
            given.strip().encode("utf-8", "backslashreplace"), token.encode("ascii")
        )

    def _wrong_job(self, request: web.Request) -> web.Response | None:
        """A 404 naming this server's job when the URL names another one."""
        asked = request.match_info.get("job_id", "")
        if asked == self.job_id:
            return None
        shown = asked if len(asked) <= 80 else asked[:77] + "..."
        return _json({"error": f"no job {shown!r} here; this server runs job {self.job_id!r}"}, 404)

    def _file(
        self, command: str, values: dict[str, Any] | None = None, client: str = "unknown"
    ) -> int:
        """File ``command`` on the loop's Control; returns the step it was filed at."""
        snap, control, state = self._snapshot, self._control, self._state
        spec = SERVER_COMMANDS[command]
        if spec.needs == "live settings":
            values = self._checked_settings(values or {}, client)
        requests = spec.requests(values or {})
        if not requests:  # Forgather's "status": nothing to file, whatever the phase
            return state.step if state is not None else 0
        if control is None or state is None or snap.phase not in ("training", "evaluating"):
            raise CommandError(f"the job is not training (it is {snap.phase})", 409)
        if spec.needs == "checkpoints" and not self._can_save:
            raise CommandError(
                f"{command}: this job has no output directory, so it cannot save checkpoints",
                409,
            )
        if spec.needs == "live settings" and self._live is None:
            raise CommandError(f"{command}: this job's loop has no live settings", 409)
        if spec.needs == "eval data" and not self._can_evaluate:
            raise CommandError(f"{command}: this job has no evaluation data", 409)
        with snap.lock:
            if snap.stopping is not None:
                raise CommandError(
                    f"{command}: the job is already ending ({snap.stopping} was filed)", 409
                )
            step = state.step
            control.request_all(requests)
            if spec.ends:
                snap.stopping = command
            snap.filed.append({"command": command, "step": step, "time": time.time()})
        log.info("control: %s filed at step %d", command, step)
        return step

    def _checked_settings(self, values: dict[str, Any], client: str) -> dict[str, Any]:
        """A ``set``'s values checked against the run (400 naming the key), as the request
        the loop applies: one entry keyed by a time-ordered id."""
        live = self._live
        if live is None:
            raise CommandError("set: this job's loop has no live settings", 409)
        try:
            checked = live.check(values)
        except ValueError as err:
            raise CommandError(f"set: {err}") from None
        ident = f"{time.time_ns():020d}"
        return {ident: {"values": checked, "client": client}}

    def _job_entry(self) -> dict[str, Any]:
        record = self._record
        state = self._state
        entry = record.to_json() if record is not None else {"job_id": self.job_id}
        entry.update(
            {
                "pid": os.getpid(),
                "url": self.url,
                "step": state.step if state is not None else None,
                "max_steps": state.max_steps if state is not None else None,
                "phase": self._snapshot.phase,
            }
        )
        return entry

    def _jobs(self) -> list[dict[str, Any]]:
        """Every live job in this server's jobs directory, this one with its live counters."""
        from hookloop.control.registry import list_jobs

        others = [r.to_json() for r in list_jobs(self.jobs_dir, clean=False)]
        return [self._job_entry()] + [j for j in others if j["job_id"] != self.job_id]

    def _status(self) -> dict[str, Any]:
        state, snap = self._state, self._snapshot
        now = time.monotonic()
        step = state.step if state is not None else 0
        max_steps = state.max_steps if state is not None else None
        rate = snap.steps_per_second(now, step)
        eta = None
        if rate and max_steps is not None:
            eta = max(max_steps - step, 0) / rate
        with snap.lock:
            now_s = time.time()
            out = {  # Forgather's keys first, in its order, then hookloop's
                "job_id": self.job_id,
                "status": "running" if snap.phase in ("training", "evaluating") else snap.phase,
                "timestamp": now_s,
                "global_step": step,
                "epoch": state.epoch if state is not None else 0,
                "max_steps": max_steps,
                "pid": os.getpid(),
                "phase": snap.phase,
                "step": step,
                "num_epochs": state.num_epochs if state is not None else None,
                "samples": state.samples if state is not None else 0,
                "elapsed_s": round(time.time() - snap.started, 3),
                "steps_per_s": round(rate, 3) if rate is not None else None,
                "eta_s": round(eta, 1) if eta is not None else None,
                "metrics": snap.logs,
                "metrics_step": snap.logs_step,
                "eval": snap.eval,
                "eval_step": snap.eval_step,
                "checkpoint": snap.checkpoint,
                # the divergences rolled back so far (hookloop.checkpoint.rewind), oldest first
                "rewinds": [r.to_json() for r in state.rewinds] if state is not None else [],
                # StragglerDetection's latest report (replaced whole, never mutated), or None
                "stragglers": self._user_state.get("stragglers"),
                "stopping": snap.stopping,
                # the values `set` can change now, and the changes applied so far
                "settings": self._live.values() if self._live is not None else None,
                "changes": list(self._live.history[-20:]) if self._live is not None else [],
                "history_seq": snap.seq,
                "recent_commands": list(snap.filed),
                "can_save": self._can_save,
                "can_evaluate": self._can_evaluate,
                "commands": list(COMMANDS),
                "time": now_s,
            }
            for key, value in snap.logs.items():  # and the latest log's keys, flat, as Forgather
                out.setdefault(key, value)
        profile = current_profile()  # callbacks.profile=true: the cost report per callback
        out["callback_profile"] = profile.rows() if profile is not None else None
        return out


#: The name Forgather uses for this callback.
TrainerControlCallback = ControlServer


class _ServerThread:
    """An asyncio loop in a daemon thread serving one aiohttp app on a bound socket."""

    def __init__(self, app: web.Application, sock: socket.socket) -> None:
        self.app = app
        self.sock = sock
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, name="hookloop-control", daemon=True)

    def start(self, timeout: float = 15.0) -> None:
        self.thread.start()
        if not self.ready.wait(timeout):
            raise RuntimeError(f"the server thread did not start within {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"the server thread failed: {self.error}") from self.error

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as err:  # reported to start(), or logged once running
            if not self.ready.is_set():
                self.error = err
                self.ready.set()
            else:
                log.warning("hookloop control server stopped: %r", err)
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self.sock.close()

    async def _serve(self) -> None:
        from aiohttp import web

        self.stopping = asyncio.Event()
        runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.SockSite(runner, self.sock).start()
            self.ready.set()
            await self.stopping.wait()
            # Stop accepting before anything closes, and let connections accepted a
            # moment ago finish their set-up: asyncio (3.11) drops, without closing
            # it, a connection whose set-up finds its server already closed, and the
            # client then hangs until it times out.
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            await asyncio.sleep(0.05)
        finally:
            await runner.cleanup()

    def stop(self, timeout: float = 10.0) -> None:
        loop, stopping = self.loop, self.stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("hookloop control server thread did not stop within %.0f s", timeout)


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the kernel picks a free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"cannot resolve control server host {host!r}: {err}") from None
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


def _base_url(host: str, port: int) -> str:
    """The URL a local client uses (an unspecified bind address means loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    from aiohttp import web

    return web.Response(
        text=json.dumps(data, allow_nan=False, default=str),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _version() -> str | None:
    try:
        from hookloop import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return None
