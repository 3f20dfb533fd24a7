"""The JSON bodies hookloop's HTTP servers read, checked before any field is used.

Both servers (the control server and the DiLoCo server) parse a body with
:func:`load_object`, which refuses, naming the field, every value JSON can carry
but no field of ours takes: NaN or an infinite number (Python's ``json`` reads
``NaN``, ``Infinity`` and ``1e999``), an integer beyond ``±2**53`` (a float of it
overflows, and JavaScript cannot hold it exactly), a string over :data:`MAX_TEXT`
characters, nesting deeper than :data:`MAX_DEPTH`. The field checkers below
(:func:`integer`, :func:`number`, :func:`text`, :func:`identifier`,
:func:`json_object`) then check one field's type and range. Each refusal is a
:class:`BodyError`, one line ``"<field> must be ..., got ..."``, which the server
answers with HTTP 400.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: The largest integer magnitude a body may hold anywhere (what a float and JavaScript keep exact).
MAX_INT = 2**53
#: The longest string a body may hold anywhere.
MAX_TEXT = 4096
#: The deepest nesting of lists and objects a body may hold.
MAX_DEPTH = 16
#: The longest id (a worker id, a client name).
MAX_ID = 200


class BodyError(ValueError):
    """A request body or one of its fields that the server refuses (HTTP 400)."""


def shown(value: Any) -> str:
    """``value`` for a one-line message: short, whatever it is."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 10**40 else "an integer of more than 40 digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return json.dumps(text)
    if isinstance(value, dict):
        return "an object"
    return "a list" if isinstance(value, list) else f"a {type(value).__name__}"


def load_object(body: bytes) -> dict[str, Any]:
    """The JSON object ``body`` holds, every value in it within this module's limits.

    >>> load_object(b'{"lr": 3e-4, "betas": [0.9, 0.95]}')
    {'lr': 0.0003, 'betas': [0.9, 0.95]}
    >>> load_object(b'{"values": {"lr": NaN}}')
    Traceback (most recent call last):
    ...
    hookloop.control.bodies.BodyError: values.lr must be a finite number, got nan
    """
    try:
        data = json.loads(body)
    except RecursionError:
        raise BodyError(f"the body nests lists or objects deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
        raise BodyError("the body must be a JSON object (UTF-8), and is not valid JSON") from None
    if not isinstance(data, dict):
        raise BodyError(f"the body must be a JSON object, got {shown(data)}")
    check_tree(data)
    return data


def check_tree(value: Any, field: str = "", depth: int = 0) -> None:
    """Refuse the first value under ``value`` that no field takes, naming its field path."""
    name = field if len(field) <= 80 else "..." + field[-77:]
    name = name or "the body"
    if depth > MAX_DEPTH:
        raise BodyError(f"{name} nests lists or objects deeper than {MAX_DEPTH} levels")
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise BodyError(f"{name} must be a number of magnitude at most 2**53, got {shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BodyError(f"{name} must be a finite number, got {shown(value)}")
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise BodyError(f"{name} must be a string of at most {MAX_TEXT} characters")
    if isinstance(value, list):
        for index, item in enumerate(value):
            check_tree(item, f"{name}[{index}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if len(key) > MAX_ID:
                raise BodyError(f"{name} has a key of more than {MAX_ID} characters")
            key = key if key.isprintable() else json.dumps(key)[1:-1]  # the message: one line
            check_tree(item, f"{field}.{key}" if field else key, depth + 1)


def integer(field: str, value: Any, *, low: int, high: int) -> int:
    """An int in ``[low, high]`` (a bool is not an int)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BodyError(f"{field} must be an integer in [{low}, {high}], got {shown(value)}")
    return value


def number(field: str, value: Any, *, low: float, high: float) -> float:
    """A finite int or float in ``[low, high]`` (a bool is not a number)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or abs(value) > MAX_INT or not math.isfinite(value) or not low <= value <= high:
        raise BodyError(f"{field} must be a number in [{low:g}, {high:g}], got {shown(value)}")
    return float(value)


def text(field: str, value: Any, *, max_len: int = MAX_ID) -> str:
    """A string of printable characters (no newline or other control), at most ``max_len``."""
    if not isinstance(value, str) or len(value) > max_len or not value.isprintable():
        raise BodyError(
            f"{field} must be a string of at most {max_len} printable characters, "
            f"got {shown(value)}"
        )
    return value


def identifier(field: str, value: Any) -> str:
    """An id: 1 to :data:`MAX_ID` printable characters, not blank."""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_ID:
        raise BodyError(
            f"{field} must be a non-empty string of at most {MAX_ID} printable characters, "
            f"got {shown(value)}"
        )
    return text(field, value)


def json_object(field: str, value: Any) -> dict[str, Any]:
    """A JSON object (its values were checked by :func:`check_tree`)."""
    if not isinstance(value, dict):
        raise BodyError(f"{field} must be a JSON object, got {shown(value)}")
    return value
