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
Every response carries a Content-Security-Policy and ``nosniff``, and an unexpected
failure is one JSON line, ``500`` (:mod:`hookloop.control.service`, shared with the
DiLoCo server).

The parts: :mod:`~hookloop.control.commands` (what a command files),
:mod:`~hookloop.control.job` (the job as the server thread sees it: the status costs
the training thread no work per step), :mod:`~hookloop.control.routes` (the handlers),
and this module, the callback that starts and stops it all and announces the job.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookloop.callback import Callback
from hookloop.control.commands import (
    COMMANDS,
    SERVER_COMMANDS,
    Command,
    CommandError,
    client_of,
    parse_command,
    parse_request,
    register_command,
)
from hookloop.control.job import LiveJob, numbers
from hookloop.control.registry import (
    JobDir,
    JobRecord,
    check_job_id,
    new_job_id,
    registries,
)
from hookloop.control.routes import ControlRoutes
from hookloop.control.service import Address, Serving, bearer_matches, is_loopback, listen
from hookloop.processes import process_start_ticks

if TYPE_CHECKING:
    from hookloop.state import CallbackContext

__all__ = [
    "COMMANDS",
    "SERVER_COMMANDS",
    "Command",
    "CommandError",
    "ControlServer",
    "TrainerControlCallback",
    "client_of",
    "is_loopback",
    "parse_command",
    "parse_request",
    "register_command",
]


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
        host = "127.0.0.1" if host is None else host
        auth_token = None if auth_token == "" else auth_token  # Forgather: "" means "make one"
        _check_arguments(port, host, auth_token, enable_http, disable_auth,
                         allow_remote_without_auth)  # fmt: skip
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
        self._job = LiveJob(self.job_id, None, None)
        self._serving: Serving | None = None
        self._record: JobRecord | None = None

    # -- events (training thread) ----------------------------------------------
    def on_train_start(self, ctx: CallbackContext) -> None:
        if not self.enable_http or not ctx.state.is_rank_zero or self._serving is not None:
            return
        self._job = LiveJob(
            self.job_id,
            ctx.state,
            ctx.control,
            settings=ctx.settings,
            user_state=ctx.user_state,  # what other callbacks publish (e.g. stragglers)
            can_save=ctx.run.can_checkpoint,
            can_evaluate=ctx.run.has_eval_data,
        )
        try:
            self._start(ctx)
        except Exception as err:
            self._stop_server()
            if self.required:
                raise
            message = f"hookloop: control server not started: {err}; training goes on without it"
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def on_log(self, ctx: CallbackContext) -> None:
        if self._serving is not None:
            self._job.snapshot.record("train", ctx.state.step, numbers(ctx.logs))

    def on_eval_start(self, ctx: CallbackContext) -> None:
        if self._serving is not None:
            self._job.snapshot.phase = "evaluating"

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if self._serving is not None:
            self._job.snapshot.record("eval", ctx.state.step, numbers(ctx.metrics))
            self._job.snapshot.phase = "training"

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        if self._serving is not None:
            with self._job.snapshot.lock:
                self._job.snapshot.checkpoint = {
                    "step": ctx.state.step,
                    "path": str(ctx.checkpoint_path),
                }

    def on_train_end(self, ctx: CallbackContext) -> None:
        self._job.snapshot.phase = "finished"
        self._stop_server()

    def on_exception(self, ctx: CallbackContext) -> None:
        self._job.snapshot.phase = "failed"
        self._stop_server()

    # -- start and stop -----------------------------------------------------------
    def _start(self, ctx: CallbackContext) -> None:
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "the control server needs aiohttp: pip install 'hookloop[control]'"
            ) from None
        self._warn_if_exposed()
        sock = listen(self.host, self.port)
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
            app = ControlRoutes(self._job, self._authorized, self._jobs).app()
        except BaseException:
            sock.close()
            raise
        self._job.snapshot.phase = "training"  # before anyone can find the endpoint
        self._serving = Serving("control")
        serving = self._serving
        serving.start(lambda ready: serving.serve(app, Address(sock=sock), ready))
        self._publish(ctx, bound_host, bound_port)

    def _warn_if_exposed(self) -> None:
        """Warn when the job can be reached from other machines, or by anyone at all."""
        if not is_loopback(self.host):
            message = (
                f"hookloop: the control server binds to {self.host}, reachable from other "
                "machines; the bearer token travels unencrypted over plain HTTP. Bind to "
                "127.0.0.1 and use an SSH tunnel unless this network is trusted."
            )
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        if self.disable_auth:
            message = (
                f"hookloop: the control server of job {self.job_id} runs WITHOUT AUTHENTICATION "
                f"(disable_auth=True): anyone who can reach {self.host} can stop, abort or "
                "save this job"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            print(message, file=sys.stderr, flush=True)

    def _publish(self, ctx: CallbackContext, host: str, port: int) -> None:
        """Write where the job listens (``endpoint.json``) in every registry, and say so."""
        assert self.job_dir is not None and self.url is not None
        run_dir = ctx.run.dir
        self._record = JobRecord(
            job_id=self.job_id,
            pid=os.getpid(),
            url=self.url,
            host=host,
            port=port,
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
        serving, self._serving = self._serving, None
        if serving is not None:
            serving.stop()
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

    # -- what the routes ask (server thread) -----------------------------------------
    def _authorized(self, header: str) -> bool:
        if self.disable_auth:
            return True
        return self.token is not None and bearer_matches(header, self.token)

    def _job_entry(self) -> dict[str, Any]:
        record = self._record
        state = self._job.state
        entry = record.to_json() if record is not None else {"job_id": self.job_id}
        entry.update(
            {
                "pid": os.getpid(),
                "url": self.url,
                "step": state.step if state is not None else None,
                "max_steps": state.max_steps if state is not None else None,
                "phase": self._job.snapshot.phase,
            }
        )
        return entry

    def _jobs(self) -> list[dict[str, Any]]:
        """Every live job in this server's jobs directory, this one with its live counters."""
        from hookloop.control.registry import list_jobs

        others = [r.to_json() for r in list_jobs(self.jobs_dir, clean=False)]
        return [self._job_entry()] + [j for j in others if j["job_id"] != self.job_id]


#: The name Forgather uses for this callback.
TrainerControlCallback = ControlServer


def _check_arguments(
    port: Any,
    host: Any,
    auth_token: Any,
    enable_http: Any,
    disable_auth: Any,
    allow_remote_without_auth: Any,
) -> None:
    """Refuse, in one line, a ControlServer argument it cannot serve with."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0: pick a free one), got {port!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be an address to bind, e.g. '127.0.0.1', got {host!r}")
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


def _base_url(host: str, port: int) -> str:
    """The URL a local client uses (an unspecified bind address means loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def _version() -> str | None:
    try:
        from hookloop import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return None
