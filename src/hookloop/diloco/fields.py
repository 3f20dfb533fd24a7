"""The fields of the DiLoCo server's JSON bodies, checked per route before the server
reads one, so a wrong type or an absurd value is answered 400 naming the field.

:func:`read_body` parses a body within :mod:`hookloop.control.bodies`' limits (no
NaN or infinity, no integer beyond ``±2**53``, no string over 4096 characters
anywhere); :func:`check_fields` then checks the fields a route reads
(:data:`FIELDS`). Fields a route does not read are let through, as Forgather's
workers send extra information on registration. What a field's value means
(a worker that is registered, a momentum below 1) the server itself checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hookloop.control.bodies import (
    MAX_ID,
    BodyError,
    identifier,
    integer,
    json_object,
    load_object,
    number,
    text,
)

#: The most workers a server may be told to expect.
MAX_WORKERS = 100_000
#: The fastest training speed a heartbeat may report, in steps per second.
MAX_STEPS_PER_SECOND = 1e9


def worker_id(value: Any) -> str:
    """A worker id: 1 to 200 printable characters (quotes and ``<`` included: the
    dashboard shows it as text)."""
    return identifier("worker_id", value)


#: What each route reads from its body: field -> checker. ``None`` (JSON null) counts as
#: absent for a field a route does not require.
FIELDS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "register": {
        "worker_id": worker_id,
        "hostname": lambda v: text("hostname", v, max_len=MAX_ID),
        "extra": lambda v: json_object("extra", v),
    },
    "heartbeat": {
        "worker_id": worker_id,
        "steps_per_second": lambda v: number(
            "steps_per_second", v, low=0, high=MAX_STEPS_PER_SECOND
        ),
    },
    "deregister": {"worker_id": worker_id},
    "kick_worker": {"worker_id": worker_id},
    "update_optimizer": {"client": lambda v: text("client", v, max_len=MAX_ID)},
    "pause": {"client": lambda v: text("client", v, max_len=MAX_ID)},
    "resume": {"client": lambda v: text("client", v, max_len=MAX_ID)},
    "update_num_workers": {
        "num_workers": lambda v: integer("num_workers", v, low=1, high=MAX_WORKERS)
    },
}
#: The fields a route cannot go without.
REQUIRED: dict[str, tuple[str, ...]] = {
    "register": ("worker_id",),
    "heartbeat": ("worker_id",),
    "deregister": ("worker_id",),
}


def check_fields(route: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` when every field ``route`` reads is within its bounds; else :class:`BodyError`."""
    for name in REQUIRED.get(route, ()):
        if data.get(name) is None:
            raise BodyError(f"{route} needs {name} in its body")
    for name, check in FIELDS.get(route, {}).items():
        if data.get(name) is not None:
            check(data[name])
    return data


def read_body(route: str, body: bytes) -> dict[str, Any]:
    """The JSON object of a ``route`` request (empty body: ``{}`` for an admin action)."""
    data = load_object(body) if body.strip() or route in REQUIRED else {}
    return check_fields(route, data)
