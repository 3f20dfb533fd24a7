"""Who may speak for a worker id on a DiLoCo server.

A worker id is a name any peer can type, so the server binds each id to a
*worker secret* it issues at ``POST /register`` (in the ``X-Worker-Secret``
header of the reply; the body stays Forgather's: the global weights). Every
later request under that id (submissions, heartbeats, leaving, registering
again) must send the secret back in the same request header; one without it,
or with another, is answered 403 and counts nothing against the real worker.
A request under an id that is not registered is answered 404 and never
reaches a round.

hookloop's workers ask for the binding by sending ``X-Worker-Binding: secret``
with their registration. Forgather's workers know nothing of it: a server
started with ``allow_unbound_workers`` (``--allow-unbound-workers``) admits
them, each *unbound* id tied to the peer address it registered from, so a
request without a secret is taken only from that address. Without the flag
such a registration is refused with the flag's name. Headers are ignored by
Forgather's server and workers, so both keep working with hookloop's.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

#: The request header carrying a worker's secret, and the reply header of ``/register``.
SECRET_HEADER = "X-Worker-Secret"
#: The request header with which a worker asks ``/register`` to bind its id to a secret.
BINDING_HEADER = "X-Worker-Binding"
#: The value of :data:`BINDING_HEADER` that asks for the binding.
BINDING_SECRET = "secret"


@dataclass
class WorkerInfo:
    """What the server knows of one registered worker (the ``workers`` of ``/status``,
    which never shows ``secret`` or ``peer``)."""

    worker_id: str
    hostname: str
    registered_at: float
    last_heartbeat: float
    sync_round: int = 0
    last_sync_server_round: int = 0
    steps_per_second: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    peer: str | None = None
    bound: bool = True


@dataclass(frozen=True)
class Caller:
    """What a request says about its sender: the secret it sent, its address, and
    (at ``/register``) whether it asked for the binding. ``Caller()``, for a call made
    in the server's own process, asks for the binding and has no address."""

    secret: str | None = None
    peer: str | None = None
    wants_binding: bool = True

    @classmethod
    def from_request(cls, headers: Mapping[str, str], peer: str | None) -> Caller:
        secret = headers.get(SECRET_HEADER)
        wants = headers.get(BINDING_HEADER, "").strip().lower() == BINDING_SECRET
        return cls(secret.strip() if secret else None, peer, wants or secret is not None)


class Refusal(NamedTuple):
    """Why a request may not speak for an id, as its HTTP status and one line."""

    status: int
    message: str


def check_member(worker_id: str, info: WorkerInfo | None, caller: Caller) -> Refusal | None:
    """None when ``caller`` may act for ``worker_id`` (registered as ``info``), else why not."""
    if info is None:
        return Refusal(
            404,
            f"worker {worker_id} is not registered (never, or it left, was kicked or went "
            "silent past heartbeat_timeout): POST /register first",
        )
    if caller.secret is not None:
        if hmac.compare_digest(caller.secret.encode("utf-8", "replace"), info.secret.encode()):
            return None
        return Refusal(403, f"wrong {SECRET_HEADER} for worker {worker_id}; "
                            "only the worker that registered this id may use it")  # fmt: skip
    if not info.bound and caller.peer is not None and caller.peer == info.peer:
        return None
    if not info.bound:
        return Refusal(
            403,
            f"worker {worker_id} registered from another address and this request sends no "
            f"{SECRET_HEADER}; an unbound worker may speak only from its own address",
        )
    return Refusal(
        403,
        f"worker {worker_id} is bound to a secret and this request sends no {SECRET_HEADER} "
        "(the one its /register reply carried)",
    )


def check_join(
    worker_id: str, info: WorkerInfo | None, caller: Caller, *, allow_unbound: bool
) -> Refusal | None:
    """None when ``caller`` may register ``worker_id`` (now registered as ``info``)."""
    if info is not None:
        refusal = check_member(worker_id, info, caller)
        if refusal is not None:
            return Refusal(
                403,
                f"worker id {worker_id} is held by a running worker ({refusal.message}); it is "
                "free again once that worker leaves, is kicked or goes silent past "
                "heartbeat_timeout: use another worker id",
            )
        return None
    if caller.wants_binding or allow_unbound:
        return None
    return Refusal(
        403,
        f"worker {worker_id} did not ask for a worker secret ({BINDING_HEADER}: "
        f"{BINDING_SECRET}), as Forgather's workers do not; the server admits such workers "
        "only when started with --allow-unbound-workers (allow_unbound_workers=True)",
    )
