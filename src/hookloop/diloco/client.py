"""A worker's requests to a DiLoCo server, in Forgather's protocol, on the standard library.

:class:`DiLoCoClient` has the methods of Forgather's client (``register``,
``submit_pseudogradients``, ``submit_fragment_pseudogradients``,
``get_global_params``, ``heartbeat``, ``deregister``, ``get_status``) and
talks to Forgather's server or ``hookloop diloco serve`` alike. hookloop adds
a bearer ``token``, HTTPS verified against the system's or a given CA bundle
(``cafile``), ``control()`` for the admin routes, and byte counters. Proxies
are ignored (a proxy would see the token).

Worker secrets (:mod:`hookloop.diloco.membership`): ``register`` asks for one and
keeps the secret the reply carries in ``secrets`` (by worker id); every later
request under that id sends it back. A server that issues none (Forgather's)
gets none.

A sync answered 503 with ``"paused": true`` (the server's outer loop is paused,
:mod:`hookloop.diloco.pause`) raises :class:`ServerPaused`. The module imports torch only
where tensors travel, so a command that merely asks a server (``hookloop diloco
pause``) starts light.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from hookloop.diloco.membership import BINDING_HEADER, BINDING_SECRET, SECRET_HEADER

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class ServerUnavailable(ConnectionError):
    """The server could not be reached, failed or timed out (worth retrying)."""


class ServerPaused(ServerUnavailable):
    """The server's outer loop is paused: train on locally, sync at the next sync point.

    ``since`` (a Unix time) and ``by`` say since when and by whom, as the server told."""

    def __init__(self, message: str, since: Any = None, by: Any = None) -> None:
        super().__init__(message)
        self.since, self.by = since, by


class ServerRefused(RuntimeError, ValueError):
    """The server answered that the request is wrong (retrying will not help).

    Also a ``ValueError``: ``hookloop train`` reports it in one line with exit code 2."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def parse_address(server_addr: str) -> str:
    """``host:port``, ``http://host:port`` or ``https://host:port`` as a base URL."""
    if not isinstance(server_addr, str) or not server_addr.strip():
        raise ValueError(f"server_addr must be 'host:port' or a URL, got {server_addr!r}")
    addr = server_addr.strip().rstrip("/")
    if "://" not in addr:
        addr = "http://" + addr
    scheme, _, rest = addr.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme not in ("http", "https") or not sep or not host or not port.isdigit():
        raise ValueError(
            "server_addr must be 'host:port', 'http://host:port' or 'https://host:port', "
            f"got {server_addr!r}"
        )
    return addr


class DiLoCoClient:
    """Requests to one server; each method is one route and blocks until answered.

    ``max_answer_bytes`` caps what is read of an answer (None: no cap, as Forgather's
    client); a tensor answer is also refused when it could inflate."""

    def __init__(
        self,
        server_addr: str,
        timeout: float = 600,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        *,
        token: str | None = None,
        cafile: str | None = None,
        max_answer_bytes: int | None = None,
    ) -> None:
        self.server_addr = parse_address(server_addr)
        self.max_answer_bytes = max_answer_bytes
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self.token = token
        handlers: list[Any] = [urllib.request.ProxyHandler({})]
        if cafile is not None and not os.path.isfile(cafile):
            raise FileNotFoundError(
                f"cafile {cafile} {'is not a file' if os.path.exists(cafile) else 'does not exist'}"
                "; give the PEM file of the CA (or the server's certificate) to trust"
            )
        if self.server_addr.startswith("https://"):
            context = ssl.create_default_context(cafile=cafile)
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)
        self.bytes_sent = 0
        self.bytes_received = 0
        #: The secret each worker id registered here was issued (share it between clients).
        self.secrets: dict[str, str] = {}

    # -- Forgather's methods ------------------------------------------------------------
    def register(
        self, worker_id: str, worker_info: Mapping[str, Any] | None = None
    ) -> dict[str, torch.Tensor]:
        """Join (or join again) and get the global weights."""
        info = {"worker_id": worker_id, "hostname": platform.node(), **(worker_info or {})}
        body = json.dumps(info).encode("utf-8")
        replied: dict[str, str] = {}
        raw = self._retrying(
            lambda: self._call("POST", "register", body, "application/json", worker_id=worker_id,
                               headers={BINDING_HEADER: BINDING_SECRET}, replied=replied),
            self.max_retries,
        )  # fmt: skip
        weights = self._tensors("register", raw)
        secret = replied.get(SECRET_HEADER.lower())
        if secret:
            self.secrets[worker_id] = secret
        return weights

    def submit_pseudogradients(
        self, worker_id: str, pseudograds: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Send the full model's pseudo-gradients; get the round's new global weights."""
        from hookloop.diloco.wire import TENSOR_TYPE, pack

        body = pack({"worker_id": worker_id}, pseudograds)
        return self._tensors("submit_pseudograd", self._call(
            "POST", "submit_pseudograd", body, TENSOR_TYPE, worker_id=worker_id
        ))  # fmt: skip

    def submit_fragment_pseudogradients(
        self, worker_id: str, fragment_id: int, pseudograds: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Send one fragment's pseudo-gradients; get its new global weights."""
        from hookloop.diloco.wire import TENSOR_TYPE, pack

        body = pack({"worker_id": worker_id, "fragment_id": fragment_id}, pseudograds)
        route = "submit_fragment_pseudograd"
        return self._tensors(
            route, self._call("POST", route, body, TENSOR_TYPE, worker_id=worker_id)
        )

    def get_global_params(self) -> dict[str, torch.Tensor]:
        return self._tensors("global_params", self._call("GET", "global_params"))

    def heartbeat(self, worker_id: str, steps_per_second: float = 0.0) -> dict[str, Any]:
        """Report speed; the answer may carry DyLU's ``recommended_sync_every``."""
        data = {"worker_id": worker_id, "steps_per_second": steps_per_second}
        return self._json("POST", "heartbeat", data, worker_id=worker_id)

    def deregister(self, worker_id: str) -> dict[str, Any]:
        return self._json("POST", "deregister", {"worker_id": worker_id}, worker_id=worker_id)

    def get_status(self) -> dict[str, Any]:
        return self._json("GET", "status")

    # -- hookloop's additions ---------------------------------------------------------
    status = get_status

    def control(self, action: str, data: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``POST /control/<action>`` (save_state, kick_worker, update_optimizer, ...)."""
        return self._json("POST", f"control/{action}", dict(data or {}))

    def _json(
        self,
        method: str,
        route: str,
        data: Mapping[str, Any] | None = None,
        *,
        worker_id: str | None = None,
    ) -> Any:
        body = None if data is None else json.dumps(dict(data)).encode("utf-8")
        raw = self._call(method, route, body, "application/json",
                         timeout=min(self.timeout, 30.0), worker_id=worker_id)  # fmt: skip
        return json.loads(raw)

    def _tensors(self, route: str, raw: bytes) -> dict[str, torch.Tensor]:
        """The tensors of the server's answer to ``route``; a body that could run code or
        inflate (:func:`hookloop.diloco.wire.load_tensors`) is refused naming the server."""
        from hookloop.diloco.wire import load_tensors

        try:
            return load_tensors(raw)
        except ValueError as err:
            raise ValueError(
                f"DiLoCo server {self.server_addr} answered /{route} with a body hookloop "
                f"refuses: {err}"
            ) from None

    def _retrying(self, call: Callable[[], T], retries: int) -> T:
        return with_retries(call, retries, first_wait=self.retry_delay)

    def _call(
        self,
        method: str,
        route: str,
        body: bytes | None = None,
        content_type: str | None = None,
        *,
        timeout: float | None = None,
        worker_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        replied: dict[str, str] | None = None,
    ) -> bytes:
        """One request; ``worker_id``'s secret goes along when known, and the reply's
        headers (names in lower case) into ``replied`` when given."""
        req = urllib.request.Request(f"{self.server_addr}/{route}", data=body, method=method)
        if self.token is not None:
            req.add_header("Authorization", f"Bearer {self.token}")
        if body is not None and content_type is not None:
            req.add_header("Content-Type", content_type)
        secret = self.secrets.get(worker_id) if worker_id is not None else None
        if secret is not None:
            req.add_header(SECRET_HEADER, secret)
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        self.bytes_sent += len(body or b"")
        try:
            with self._opener.open(req, timeout=timeout or self.timeout) as response:
                cap = self.max_answer_bytes
                raw = response.read() if cap is None else response.read(cap + 1)
                if replied is not None:
                    replied.update((k.lower(), v) for k, v in response.headers.items())
        except urllib.error.HTTPError as err:
            raw = err.read(4096).decode("utf-8", "replace")
            answer: Any = None
            with contextlib.suppress(ValueError):
                answer = json.loads(raw)
            detail = str(answer.get("error", raw) if isinstance(answer, dict) else raw)[:500]
            message = f"DiLoCo server {self.server_addr} answered {err.code} to /{route}: {detail}"
            if err.code == 503 and isinstance(answer, dict) and answer.get("paused") is True:
                raise ServerPaused(message, answer.get("paused_since"),
                                   answer.get("paused_by")) from None  # fmt: skip
            if err.code >= 500:
                raise ServerUnavailable(message) from None
            raise ServerRefused(message, err.code) from None
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
            reason = getattr(err, "reason", err)
            raise ServerUnavailable(
                f"DiLoCo server {self.server_addr} unreachable: {reason}"
            ) from None
        self.bytes_received += len(raw)
        if self.max_answer_bytes is not None and len(raw) > self.max_answer_bytes:
            raise ValueError(
                f"DiLoCo server {self.server_addr} answered /{route} with more than "
                f"{self.max_answer_bytes} bytes, the most this client reads"
            )
        return raw


def with_retries(
    call: Callable[[], T],
    retries: int,
    *,
    on_retry: Callable[[int, Exception], None] | None = None,
    first_wait: float = 0.5,
    max_wait: float = 8.0,
) -> T:
    """``call()``, tried again up to ``retries`` times after :class:`ServerUnavailable`,
    waiting ``first_wait`` seconds and then twice as long each time (at most ``max_wait``)."""
    wait = first_wait
    for attempt in range(retries + 1):
        try:
            return call()
        except ServerUnavailable as err:
            if attempt == retries:
                raise ServerUnavailable(f"{err} (gave up after {retries + 1} attempts)") from None
            if on_retry is not None:
                on_retry(attempt + 1, err)
            time.sleep(wait)
            wait = min(wait * 2, max_wait)
    raise AssertionError("unreachable")  # pragma: no cover
