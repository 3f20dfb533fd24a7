"""The watchdog's beats as they cross the store: written to fit, read only when they check.

Every rank's watchdog (:mod:`hookloop.watchdog`) reads the other ranks' beats from a
``torch.distributed.TCPStore``, which anyone who reaches its port may write. So a value
read there is input, not a record: :func:`check_beat` turns it into a beat or refuses it.

- its size is capped (:data:`MAX_BEAT_BYTES`) before it is parsed;
- it is a JSON object (no ``NaN``, no nesting past the recursion limit) with exactly the
  fields of :data:`FIELDS`, each of its type and range: whole numbers bounded, durations
  finite and >= 0, ``state`` one of :data:`STATES`, ``rank`` the rank of its key, texts
  bounded in length;
- its texts lose their control characters (escape sequences, carriage returns, bidi
  overrides, lone surrogates), the stack keeping newlines and tabs, so a forged host or
  stack cannot move a terminal's cursor, recolour it, or split a ``progress.txt`` line.

:class:`BeatReader` ignores a refused value (the rank's last good beat stands), says so
once per rank and reason, and remembers why, so a rank whose beats stay refused is named
as not beating with that reason. The sender fits its own beat (:func:`encode_beat`): a
deep stack keeps its innermost frames, so a real beat is never refused.

These checks keep a malformed value from stopping the watchdog or reaching a terminal;
they do not authenticate: a well-formed forged beat is believed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The largest value read from the store; a larger one is refused before it is parsed.
MAX_BEAT_BYTES = 64 * 1024
#: The longest one-line text (host, event, callback, collective, frame).
MAX_TEXT = 512
#: The longest stack; the sender keeps the innermost frames of a longer one.
MAX_STACK = 48 * 1024
MAX_WHOLE = 2**63 - 1
MAX_PID = 2**31 - 1
#: The longest duration (deadline, still_s, stuck_s) and the latest wall-clock time.
MAX_SECONDS, MAX_TIME = 1e9, 1e11
STATES = ("running", "paused", "hung", "finished", "failed")

# Escape and other control characters, line and paragraph separators, bidi overrides,
# lone surrogates (which no terminal can print); a stack keeps its newlines and tabs.
_NOT_IN_A_LINE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_NOT_IN_A_STACK = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


class RefusedBeat(ValueError):
    """A store value that is not a beat. ``check`` names the check it failed (said once
    per rank and check); the message says what was wrong and what is allowed."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


@dataclass(frozen=True)
class Field:
    """One field of a beat: what it may hold, and how it is checked and cleaned
    (``clean`` raises ValueError for a value outside ``allowed``)."""

    allowed: str
    clean: Callable[[Any], Any]


def _whole(top: int) -> Field:
    def clean(value: Any) -> int:
        if type(value) is not int or not 0 <= value <= top:
            raise ValueError
        return value

    return Field(f"a whole number from 0 to {top}", clean)


def _seconds(top: float) -> Field:
    def clean(value: Any) -> float:
        if type(value) not in (int, float) or not 0 <= value <= top:  # NaN compares false
            raise ValueError
        return float(value)

    return Field(f"a finite number of seconds from 0 to {top:.0f}", clean)


def _text(longest: int, breakers: re.Pattern[str] = _NOT_IN_A_LINE) -> Field:
    def clean(value: Any) -> str | None:
        if value is None:
            return None
        if type(value) is not str or len(value) > longest:
            raise ValueError
        return breakers.sub("", value)

    return Field(f"null or a text of at most {longest} characters", clean)


def _one_of(names: Sequence[str]) -> Field:
    def clean(value: Any) -> str:
        if value not in names or type(value) is not str:
            raise ValueError
        return value

    return Field("one of " + ", ".join(names), clean)


#: A beat's fields, in the order the sender writes them (``rank`` is checked against the
#: key it was read from, before these).
FIELDS: dict[str, Field] = {
    "rank": _whole(MAX_WHOLE), "host": _text(MAX_TEXT), "pid": _whole(MAX_PID),
    "step": _whole(MAX_WHOLE), "event": _text(MAX_TEXT), "callback": _text(MAX_TEXT),
    "collective": _text(MAX_TEXT), "frame": _text(MAX_TEXT), "time": _seconds(MAX_TIME),
    "seq": _whole(MAX_WHOLE), "state": _one_of(STATES), "deadline": _seconds(MAX_SECONDS),
    "still_s": _seconds(MAX_SECONDS), "stuck_s": _seconds(MAX_SECONDS),
    "stack": _text(MAX_STACK, _NOT_IN_A_STACK),
}  # fmt: skip


def check_beat(value: bytes, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s beat from the value under its key: None while it has not beaten
    (``null``, set when the store opens); :class:`RefusedBeat` when it is no beat."""
    if len(value) > MAX_BEAT_BYTES:
        raise RefusedBeat("size", f"it is {len(value)} bytes; at most {MAX_BEAT_BYTES} are allowed")
    if value == b"null":
        return None
    beat = _parse(value)
    keys = set(beat)
    if keys != set(FIELDS):
        missing, unknown = _names(sorted(set(FIELDS) - keys)), _names(sorted(keys - set(FIELDS)))
        wrong = "; ".join(
            ([f"it lacks {missing}"] if missing else [])
            + ([f"it has unknown fields {unknown}"] if unknown else [])
        )
        raise RefusedBeat("fields", f"{wrong}; allowed: exactly {_names(FIELDS)}")
    if beat["rank"] != rank or type(beat["rank"]) is not int:
        raise RefusedBeat(
            "rank", f"it says rank {_shown(beat['rank'])}; allowed: {rank}, its key's rank"
        )
    checked = {}
    for name, field in FIELDS.items():
        try:
            checked[name] = field.clean(beat[name])
        except ValueError:
            raise RefusedBeat(
                f"field {name}", f"field {name!r} is {_shown(beat[name])}; allowed: {field.allowed}"
            ) from None
    return checked


def _parse(value: bytes) -> dict[str, Any]:
    try:
        beat = json.loads(value.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise RefusedBeat(
            "json", f"it is not UTF-8 (byte {err.start}); allowed: a JSON object"
        ) from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise RefusedBeat(
            "json", f"it is not JSON ({_clip(str(err))}); allowed: a JSON object"
        ) from None
    if not isinstance(beat, dict):
        raise RefusedBeat("json", f"it is a JSON {type(beat).__name__}; allowed: a JSON object")
    return beat


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no number")


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(_clip(n)) for n in list(names)[:20])


def _clip(text: str, longest: int = 80) -> str:
    return text if len(text) <= longest else text[: longest - 3] + "..."


def _shown(value: Any) -> str:
    """A value as a line may show it: its ``repr`` (control characters escaped), clipped."""
    return _clip(repr(value), 60)


def waits_on_me(peers: Iterable[Mapping[str, Any]], patience: float) -> bool:
    """Whether another rank waits, by its checked beat: running, its thread still for
    ``patience`` seconds or more, and in a collective or outside any callback (a rank in a
    slow callback of its own waits on nobody).

    >>> waits_on_me([{"state": "running", "still_s": 4, "collective": "agree_flags",
    ...               "callback": None}], 2.0)
    True
    >>> waits_on_me([{"state": "running", "still_s": 4, "collective": None,
    ...               "callback": "Upload"}], 2.0)
    False
    """
    return any(
        b["state"] == "running"
        and b["still_s"] >= patience
        and (b["collective"] is not None or b["callback"] is None)
        for b in peers
    )


class BeatReader:
    """Turns the store's values into checked beats. A refused value is left out (the
    rank's last good beat stands), said once per rank and check, and kept in ``refused``
    (rank -> why) until a good beat of that rank comes. A value that did not change since
    the last read is left out too: it was read already."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.refused: dict[int, str] = {}
        self._say = say
        self._said: set[tuple[int, str]] = set()
        self._last: dict[int, bytes] = {}

    def read(self, values: Iterable[bytes]) -> dict[int, dict[str, Any] | None]:
        """Rank -> its beat (None: not yet beaten) for each value read this time."""
        beats: dict[int, dict[str, Any] | None] = {}
        for rank, raw in enumerate(values):
            value = bytes(raw)
            if self._last.get(rank) == value:
                continue
            self._last[rank] = value
            try:
                beats[rank] = check_beat(value, rank)
            except RefusedBeat as refusal:
                self._refuse(rank, refusal)
            else:
                self.refused.pop(rank, None)
        return beats

    def _refuse(self, rank: int, refusal: RefusedBeat) -> None:
        self.refused[rank] = f"its beats were refused: {refusal}"
        if (rank, refusal.check) not in self._said:
            self._said.add((rank, refusal.check))
            self._say(
                f"hookloop watchdog: ignoring a beat of rank {rank}: {refusal}. Its last good "
                f"beat stands; without a good one for the deadline it is named as hung."
            )


def encode_beat(beat: Mapping[str, Any]) -> str:
    """This rank's beat as JSON that :func:`check_beat` takes: texts cut to their caps, a
    stack to its innermost frames, the whole within :data:`MAX_BEAT_BYTES` (the JSON is
    ASCII: one character, one byte)."""
    fitted = {name: _fit(name, value) for name, value in beat.items()}
    text = json.dumps(fitted)
    for _ in range(3):  # a cut adds one line; the second pass always fits
        over = len(text) - MAX_BEAT_BYTES
        if over <= 0:
            return text
        stack = str(fitted.get("stack") or "")
        fitted["stack"] = _innermost(stack, len(stack) - over - 80)
        text = json.dumps(fitted)
    fitted["stack"] = None
    return json.dumps(fitted)


def _fit(name: str, value: Any) -> Any:
    if name == "stack" and isinstance(value, str):
        return _innermost(value, MAX_STACK - 80)
    if name in ("deadline", "still_s", "stuck_s") and isinstance(value, float):
        return min(max(value, 0.0), MAX_SECONDS) if math.isfinite(value) else MAX_SECONDS
    if isinstance(value, str):
        return value[:MAX_TEXT]
    return value


def _innermost(stack: str, keep: int) -> str:
    """The last ``keep`` characters of ``stack`` from a frame's first line (``  File``),
    after a line saying how much was cut (the innermost frames say where a thread is)."""
    if len(stack) <= keep:
        return stack
    tail = stack[len(stack) - max(keep, 0) :]
    start = tail.find("\n  File ")
    tail = tail[start + 1 :] if start >= 0 else ""
    return f"[{len(stack) - len(tail)} characters of outer frames cut]\n{tail}"
