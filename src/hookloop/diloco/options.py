"""The DiLoCo server's arguments checked, each refusal one line naming the argument:
numbers and counts, the token and who may reach the server without one, the HTTPS
files, and the default outer optimizer (SGD, lr 0.7, Nesterov momentum 0.9).
"""

from __future__ import annotations

import math
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookloop.control.service import is_loopback, one_line

if TYPE_CHECKING:  # torch is imported where an optimizer is built: `hookloop diloco
    import torch  # pause` and the other commands that only talk to a server start light

#: The longest heartbeat timeout accepted (0 disables eviction).
MAX_HEARTBEAT_TIMEOUT = 86400.0
#: The default bound on ||pseudo-gradient|| / ||global weights|| of one submission: an
#: honest period of local steps moves the weights by a fraction of their norm; a worker
#: that diverged to huge but finite values moves them by orders of magnitude more.
MAX_UPDATE_RATIO = 10.0


def number(name: str, value: Any, *, low: float, high: float | None = None) -> float:
    """A finite int or float in ``[low, high]`` (a bool is not a number)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < low or (high is not None and value > high):
        span = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ValueError(f"{name} must be a number {span}, got {value!r}")
    return float(value)


def momentum(name: str, value: Any) -> float:
    """A momentum: a number in ``[0, 1)``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def integer(name: str, value: Any, low: int) -> int:
    """An int of at least ``low`` (a bool is not an int)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def flag(name: str, value: Any) -> bool:
    """True or False, nothing that merely converts to one."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def address(host: Any, port: Any) -> tuple[str, int]:
    """The host and port to bind (port None: Forgather's 8512; 0: any free one)."""
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host must be an address to bind (e.g. 127.0.0.1), got {host!r}")
    port = 8512 if port is None else port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0: any free), got {port!r}")
    return host, port


def check_auth(token: Any, disable_auth: Any, allow_remote: Any) -> None:
    """A token workers can send, or none with ``disable_auth``; never both."""
    flag("disable_auth", disable_auth)
    flag("allow_remote_without_auth", allow_remote)
    if token is not None and (
        not isinstance(token, str) or len(token) < 16 or not token.isascii()
        or not token.isprintable() or " " in token
    ):  # fmt: skip
        raise ValueError(
            "token must be a printable ASCII string of at least 16 characters without spaces"
        )
    if token is not None and disable_auth:
        raise ValueError("pass either token= or disable_auth=True, not both")


def check_exposure(host: str, token: str | None, disable_auth: bool, allow_remote: bool) -> None:
    """Refuse to serve without a token unless told to, and then only on loopback unless
    also told so; say loudly that it serves without one."""
    if token is None and not disable_auth:
        raise ValueError(
            "the DiLoCo server needs token= (workers send it as a bearer token) or "
            "disable_auth=True to admit tokenless peers such as Forgather's workers"
        )
    if disable_auth and not is_loopback(host) and not allow_remote:
        raise ValueError(
            f"disable_auth=True on host {host!r} would let anyone who reaches it "
            "change the model: bind to 127.0.0.1, set a token, or also pass "
            "allow_remote_without_auth=True"
        )
    if disable_auth:
        where = "loopback only" if is_loopback(host) else "REACHABLE FROM OTHER MACHINES"
        print(
            f"WARNING: hookloop diloco: serving on {host} WITHOUT AUTHENTICATION "
            f"({where}): anyone who can reach it can change the model or shut it down",
            file=sys.stderr, flush=True,
        )  # fmt: skip


def check_tls_files(certfile: str | None, keyfile: str | None) -> None:
    """Both PEM files for HTTPS, or neither."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("HTTPS needs both certfile and keyfile (got only one)")
    for what, file in (("certfile", certfile), ("keyfile", keyfile)):
        if file is not None and not Path(file).is_file():
            raise FileNotFoundError(
                f"{what} {file} {'is not a file' if Path(file).exists() else 'does not exist'}"
                "; give the PEM file for HTTPS"
            )


def tls_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The server's TLS context (None: plain HTTP)."""
    if certfile is None or keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as err:
        raise ValueError(
            f"certfile {certfile} / keyfile {keyfile}: not a PEM certificate "
            f"and its key ({one_line(err)})"
        ) from None
    return context


def sgd_factory(
    outer_lr: Any, outer_momentum: Any, nesterov: bool
) -> Callable[[Any], torch.optim.Optimizer]:
    """The default outer optimizer: SGD with (Nesterov) momentum, its arguments checked."""
    number("outer_lr", outer_lr, low=1e-12)
    momentum("outer_momentum", outer_momentum)
    if nesterov and outer_momentum == 0:
        raise ValueError("nesterov=True needs outer_momentum > 0 (or pass nesterov=False)")

    def outer_optimizer_factory(params: Any) -> torch.optim.Optimizer:
        import torch

        return torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)

    return outer_optimizer_factory
