"""Talk to a running job: read its status, send it commands.

A small synchronous client on the standard library (the CLI has no event loop
to run). Proxies from the environment are ignored: the control endpoint is
local, and a proxy would see the bearer token.

>>> from hookloop.control.client import JobClient
>>> client = JobClient.find("my-job")          # doctest: +SKIP
>>> client.status()["step"]                    # doctest: +SKIP
>>> client.command("save_checkpoint")          # doctest: +SKIP
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hookloop.control.registry import JobRecord, find_job
from hookloop.control.server import COMMANDS

#: CLI spellings of the commands (``hookloop ctl JOB stop`` ...).
ALIASES = {
    "stop": "graceful_stop",
    "save": "save_checkpoint",
    "save-and-stop": "save_and_stop",
    "abort": "abort",
    "eval": "evaluate_now",
}

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def client_name() -> str:
    """How a change this client sends is recorded: ``hookloop ctl (user@host)``."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "?"
    return f"hookloop ctl ({user}@{socket.gethostname()})"


class ControlError(RuntimeError):
    """The job answered with an error (``status`` is the HTTP code, 0 if unreachable)."""

    def __init__(self, message: str, status: int = 0, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class JobClient:
    """Requests to one job's control server, authenticated with its token."""

    def __init__(self, url: str, job_id: str, token: str, *, timeout: float = 5.0) -> None:
        self.url = url if url.endswith("/") else url + "/"
        self.job_id = job_id
        self.token = token
        self.timeout = timeout

    @classmethod
    def from_record(cls, record: JobRecord, *, timeout: float = 5.0) -> JobClient:
        return cls(record.url, record.job_id, record.read_token(), timeout=timeout)

    @classmethod
    def find(
        cls, ref: str, *, jobs_dir: str | Path | None = None, timeout: float = 5.0
    ) -> JobClient:
        """The client for a live job given by id, unique id prefix, or pid."""
        return cls.from_record(find_job(ref, jobs_dir), timeout=timeout)

    def request(self, method: str, route: str, body: Any = None) -> tuple[int, Any]:
        """``(status, decoded JSON)`` of one request; ``ControlError`` if unreachable."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.url + route.lstrip("/"), data=data, method=method)
        if self.token:  # "": a job serving without authentication (Forgather's older ones)
            req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with _NO_PROXY.open(req, timeout=self.timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ControlError(
                f"job {self.job_id} at {self.url} cannot be reached: {reason}"
            ) from None
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode("utf-8", "replace")
        return status, decoded

    def _checked(self, method: str, route: str, body: Any = None) -> Any:
        status, decoded = self.request(method, route, body)
        if status >= 400:
            # hookloop says "error"; Forgather's 401 says "detail"
            message = (
                decoded.get("error") or decoded.get("detail")
                if isinstance(decoded, dict)
                else decoded
            )
            raise ControlError(f"job {self.job_id}: HTTP {status}: {message}", status, decoded)
        return decoded

    def status(self) -> dict[str, Any]:
        return self._checked("GET", f"jobs/{self.job_id}/status")

    def history(self, after: int = 0) -> dict[str, Any]:
        return self._checked("GET", f"jobs/{self.job_id}/history?after={int(after)}")

    def command(
        self,
        command: str,
        values: dict[str, Any] | None = None,
        *,
        known: list[str] | None = None,
    ) -> dict[str, Any]:
        """Send a command (canonical name or CLI alias), with the ``values`` it takes;
        returns the acknowledgement. ``known``: the commands the server says it takes
        (its status's ``commands``), for a command registered there and not here. The
        server checks the values (HTTP 400 naming what is wrong)."""
        name = ALIASES.get(command, command)
        valid = [*COMMANDS, *(known or ())]
        if name not in valid:
            raise ValueError(
                f"unknown command {command!r}; valid: {', '.join(dict.fromkeys(valid))} "
                f"(or {', '.join(ALIASES)})"
            )
        body: dict[str, Any] = {"command": name}
        if name in (
            "set",
            "unset",
            "pause",
            "resume",
        ):  # recorded with the change; other commands send Forgather's body
            body["client"] = client_name()
        if values:
            body["values"] = dict(values)
        return self._checked("POST", f"jobs/{self.job_id}/control", body)
