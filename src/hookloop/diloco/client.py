"""A worker's requests to the DiLoCo server, on the standard library.

Synchronous (the training loop has no event loop), proxies ignored (a proxy
would see the token), HTTPS verified against the system's or a given CA
bundle. Every byte sent and received is counted, which is what the
``diloco/bytes_sent`` metric and the bf16 measurement report.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from hookloop.diloco.wire import CONTENT_TYPE, decode, encode

T = TypeVar("T")


class ServerUnavailable(RuntimeError):
    """The server could not be reached or failed (worth retrying)."""


class ServerRefused(RuntimeError):
    """The server answered that the request is wrong (retrying will not help)."""

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
            f"server_addr must be 'host:port', 'http://host:port' or 'https://host:port', "
            f"got {server_addr!r}"
        )
    return addr


class DiLoCoClient:
    """Requests to one server, authenticated with its token when it has one."""

    def __init__(
        self,
        server_addr: str,
        *,
        token: str | None = None,
        timeout: float = 600.0,
        cafile: str | None = None,
    ) -> None:
        self.url = parse_address(server_addr)
        self.token = token
        self.timeout = timeout
        handlers: list[Any] = [urllib.request.ProxyHandler({})]
        if self.url.startswith("https://"):
            handlers.append(
                urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=cafile))
            )
        self._opener = urllib.request.build_opener(*handlers)
        self.bytes_sent = 0
        self.bytes_received = 0

    def join(
        self, weights: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Send our weights (used only by the first worker); get the global ones."""
        return decode(self._post("v1/join", encode(weights, meta), CONTENT_TYPE))

    def sync(
        self,
        pseudo_grads: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        *,
        bf16: bool,
        timeout: float | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Send one fragment's pseudo-gradient; wait for the round's new weights."""
        body = encode(pseudo_grads, meta, dtype=torch.bfloat16 if bf16 else None)
        return decode(self._post("v1/sync", body, CONTENT_TYPE, timeout=timeout))

    def heartbeat(self, worker_id: str, steps_per_sec: float | None) -> dict[str, Any]:
        return self._json("v1/heartbeat", {"worker_id": worker_id, "steps_per_sec": steps_per_sec})

    def leave(self, worker_id: str) -> dict[str, Any]:
        return self._json("v1/leave", {"worker_id": worker_id})

    def status(self) -> dict[str, Any]:
        return json.loads(self._request("v1/status", None, None, "GET", self.timeout))

    def _json(self, route: str, data: Mapping[str, Any]) -> dict[str, Any]:
        body = json.dumps(dict(data)).encode("utf-8")
        timeout = min(self.timeout, 30.0)
        return json.loads(self._post(route, body, "application/json", timeout=timeout))

    def _post(
        self, route: str, body: bytes, content_type: str, *, timeout: float | None = None
    ) -> bytes:
        self.bytes_sent += len(body)
        raw = self._request(route, body, content_type, "POST", timeout or self.timeout)
        self.bytes_received += len(raw)
        return raw

    def _request(
        self, route: str, body: bytes | None, content_type: str | None, method: str, timeout: float
    ) -> bytes:
        req = urllib.request.Request(f"{self.url}/{route}", data=body, method=method)
        if self.token is not None:
            req.add_header("Authorization", f"Bearer {self.token}")
        if content_type is not None:
            req.add_header("Content-Type", content_type)
        try:
            with self._opener.open(req, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:500].decode("utf-8", "replace")
            with_reason = f"DiLoCo server {self.url} answered {err.code} to {route}: {detail}"
            if err.code >= 500:
                raise ServerUnavailable(with_reason) from None
            raise ServerRefused(with_reason, err.code) from None
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
            reason = getattr(err, "reason", err)
            raise ServerUnavailable(f"DiLoCo server {self.url} unreachable: {reason}") from None


def with_retries(
    call: Callable[[], T],
    retries: int,
    *,
    on_retry: Callable[[int, Exception], None] | None = None,
    first_wait: float = 0.5,
    max_wait: float = 8.0,
) -> T:
    """``call()``, tried again up to ``retries`` times after :class:`ServerUnavailable`,
    waiting 0.5 s, 1 s, 2 s ... (at most ``max_wait``) in between."""
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
