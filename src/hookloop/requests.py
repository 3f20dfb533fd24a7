"""Requests: what callbacks (and the control server's thread) ask of the loop.

State is read, Control is asked, the loop decides. A callback files a request on
``ctx.control``; the loop takes every pending request at the end of the step, agrees
them across ranks once, and acts on each kind at a documented point (see
:class:`Control`). A request is a *kind* (a name of :data:`KINDS`) and a payload of
named values (``stop`` carries its ``reason``, ``rewind`` its ``request``, a
command added later whatever it needs): the same one mechanism files, drains,
agrees and checkpoints them all, so a new kind is a name here and a handler in
the loop.

>>> control = Control()
>>> control.request_stop("enough")
>>> control.request_log()
>>> taken = control.take()
>>> taken.stop, taken.log, taken.save
('enough', True, False)
"""

from __future__ import annotations

import difflib
import hashlib
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hookloop.distributed import agree_flags, gather_objects

#: Every kind of request, and what the loop does about it at the end of the step. Every
#: rank must register the same kinds (in any order): the cross-rank agreement gives each
#: a slot by its name and refuses kinds that differ between ranks (:func:`agree`).
KINDS: dict[str, str] = {
    "log": "fire the logging events",
    "evaluate": "run an evaluation",
    "save": "write a checkpoint",
    "stop": "finish the step, save (when checkpointing is on) and end training",
    "abort": "end training at once, saving nothing",
    "failed": "mark the run failed (exit code 4); comes with a stop or an abort",
    "rewind": "roll back to a checkpoint before a divergence and go on",
    "signal": "a SIGTERM/SIGINT was caught (comes with a stop)",
}
#: ``Control.next_due`` when no request waits for a later step.
NEVER = sys.maxsize
#: The kinds the loop and its schedules decide on themselves.
BUILT_IN_KINDS = frozenset(KINDS)


def register_kind(kind: str, doc: str) -> None:
    """Add a kind of request (a new command of the control server, say); the loop needs a
    handler for it (:mod:`hookloop.loop.trainer`). Registering the same kind again with
    the same doc is a no-op."""
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ValueError(f"a request kind must be an identifier, got {kind!r}")
    if KINDS.get(kind, doc) != doc:
        raise ValueError(f"request kind {kind!r} is already registered as {KINDS[kind]!r}")
    KINDS[kind] = doc


def check_kind(kind: object) -> str:
    """``kind`` if it is a registered kind, else a ``ValueError`` naming the valid ones."""
    if isinstance(kind, str) and kind in KINDS:
        return kind
    close = difflib.get_close_matches(kind, KINDS, n=1) if isinstance(kind, str) else []
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown request kind {kind!r}.{hint} Valid kinds: {', '.join(KINDS)}.")


class Requests(Mapping[str, dict[str, Any]]):
    """The requests taken at one step boundary: kind -> its values (read-only).

    The built-in kinds read as attributes too: ``log``, ``evaluate``, ``save``,
    ``failed`` (bools), ``stop`` / ``abort`` (the reason given, or None), ``signal``
    (the number of a caught SIGTERM/SIGINT, or None), ``rewind`` (the
    :class:`RewindRequest`, or None).
    """

    __slots__ = ("_asked",)

    def __init__(self, asked: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._asked = {kind: dict(values) for kind, values in (asked or {}).items()}

    def __getitem__(self, kind: str) -> dict[str, Any]:
        return self._asked[kind]

    def __contains__(self, kind: object) -> bool:
        return kind in self._asked

    def __iter__(self) -> Iterator[str]:
        return iter(self._asked)

    def __len__(self) -> int:
        return len(self._asked)

    def merge(self, other: Mapping[str, Mapping[str, Any]]) -> Requests:
        """Both sets of requests; where both carry a value, this one's holds."""
        merged = {kind: dict(values) for kind, values in self._asked.items()}
        for kind, values in other.items():
            mine = merged.setdefault(kind, {})
            for key, value in values.items():
                mine.setdefault(key, value)
        return Requests(merged)

    def without(self, *kinds: str) -> Requests:
        return Requests({k: v for k, v in self._asked.items() if k not in kinds})

    @property
    def log(self) -> bool:
        return "log" in self._asked

    @property
    def evaluate(self) -> bool:
        return "evaluate" in self._asked

    @property
    def save(self) -> bool:
        return "save" in self._asked

    @property
    def failed(self) -> bool:
        return "failed" in self._asked

    @property
    def stop(self) -> str | None:
        return self._reason("stop", "stop requested")

    @property
    def abort(self) -> str | None:
        return self._reason("abort", "abort requested")

    @property
    def signal(self) -> int | None:
        return self._asked["signal"].get("number") if "signal" in self._asked else None

    @property
    def rewind(self) -> RewindRequest | None:
        return self._asked["rewind"].get("request") if "rewind" in self._asked else None

    def _reason(self, kind: str, default: str) -> str | None:
        values = self._asked.get(kind)
        return None if values is None else str(values.get("reason") or default)

    def __repr__(self) -> str:
        return f"Requests({self._asked!r})"


#: Nothing asked (shared: never changed).
NO_REQUESTS = Requests()


def agree(requests: Requests, device: Any, *, skipped: int = 0) -> Requests:
    """The same requests on every rank, whichever rank filed them (the control server
    lives on rank 0 alone), in one collective of at most 64 bytes: a fingerprint of the
    registered kinds, the count of skipped updates (``skipped``), a values flag, and a bit
    per kind in name order. A second collective, only when some rank's request carries
    values (a stop's reason, a rewind), gathers them, and the lowest asking rank's value
    holds. A kind registered on some ranks only (:class:`KindsDiffer`) or an update
    skipped on some ranks only (:class:`SkipsDiffer`) is an error on every rank, never a
    reduction of flags that mean different things."""
    kinds, fingerprint = kind_layout()
    asked = [kind in requests for kind in kinds]
    values = int(any(requests[kind] for kind in requests))
    payload = [fingerprint, -fingerprint, skipped, -skipped, values, *pack_bits(asked)]
    agreed = agree_flags(payload, device)  # element-wise MAX: -max(-x) is the min
    if agreed[0] != -agreed[1]:  # max != min: the ranks' kinds differ
        raise KindsDiffer.from_ranks(gather_objects(kinds))
    if agreed[2] != -agreed[3]:
        raise SkipsDiffer.from_ranks(gather_objects(skipped))
    flags = unpack_bits(agreed[5:], len(kinds))
    if not any(flags):
        return NO_REQUESTS
    if not agreed[4]:
        return Requests({kind: {} for kind, flag in zip(kinds, flags, strict=True) if flag})
    merged = NO_REQUESTS
    for theirs in gather_objects(dict(requests.items())):  # in rank order
        merged = merged.merge(theirs)
    return merged


#: Flags per packed word (an int64 holds 62 without touching the sign).
BITS_PER_WORD = 62
_layout_cache: tuple[int, list[str], int] = (-1, [], 0)


def kind_layout() -> tuple[list[str], int]:
    """The registered kinds in name order (each kind's slot depends on the set of names,
    not on the order modules registered them in) and a 56-bit fingerprint of that set."""
    global _layout_cache
    if _layout_cache[0] != len(KINDS):  # kinds are only ever added
        kinds = sorted(KINDS)
        digest = hashlib.blake2b("\n".join(kinds).encode(), digest_size=7).digest()
        _layout_cache = (len(KINDS), kinds, int.from_bytes(digest, "big"))
    return _layout_cache[1], _layout_cache[2]


def pack_bits(flags: list[bool]) -> list[int]:
    words = [0] * max(1, -(-len(flags) // BITS_PER_WORD))
    for index, flag in enumerate(flags):
        if flag:
            words[index // BITS_PER_WORD] |= 1 << (index % BITS_PER_WORD)
    return words


def unpack_bits(words: list[int], count: int) -> list[bool]:
    return [bool(words[i // BITS_PER_WORD] >> (i % BITS_PER_WORD) & 1) for i in range(count)]


class KindsDiffer(RuntimeError):
    """The ranks registered different request kinds: a plug-in imported on some ranks
    only, or a kind registered by a callback built on one rank."""

    @classmethod
    def from_ranks(cls, per_rank: list[list[str]]) -> KindsDiffer:
        every = set.intersection(*map(set, per_rank))
        odd = sorted({kind for kinds in per_rank for kind in kinds} - every)
        holders = {kind: [r for r, kinds in enumerate(per_rank) if kind in kinds] for kind in odd}
        where = "; ".join(
            f"{kind!r} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} only"
            for kind, ranks in holders.items()
        )
        return cls(
            f"request kinds differ across ranks: {where}; every rank must register the same "
            "kinds (import the module that registers them on every rank, before training)"
        )


class SkipsDiffer(RuntimeError):
    """Some ranks skipped an update the others applied (``skip_step()`` called on some
    ranks only): their weights no longer match, so training cannot go on."""

    @classmethod
    def from_ranks(cls, per_rank: list[int]) -> SkipsDiffer:
        counts = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(per_rank))
        return cls(
            f"the ranks skipped different optimizer updates (skipped so far: {counts}); "
            "with several ranks, call skip_step() on every rank alike, deciding from values "
            "every rank shares (the grad norm, an all-reduced loss)"
        )


class Control:
    """Requests from callbacks (or the control server's thread) to the loop.

    Where the loop acts on each request:

    - ``skip_step()``: just before ``optimizer.step()`` of the current step
      (so it may be called up to ``on_before_optimizer_step``); the step then
      counts as skipped. It is not agreed across ranks (that would cost a collective
      before every update): with several ranks, call it on every rank alike; a skip
      on some ranks only is an error on every rank at the step's end (:class:`SkipsDiffer`).
    - ``request_log()``, ``request_evaluate()``, ``request_save()``,
      ``request_stop()``, ``request_abort()``, ``request_rewind()`` and any
      :meth:`request` of a kind added to :data:`KINDS`: at the end of the current
      step, after ``on_train_step_end``, in that order (log, evaluate, rewind, save,
      stop). A stop saves a checkpoint when checkpointing is configured; an abort
      ends at once and saves nothing. Requests filed outside a step wait for the next.

    Filing the same kind twice keeps the first filing's values (the first stop reason).
    Requests are thread-safe: another thread may file them at any time.
    """

    __slots__ = ("_asked", "_later", "_lock", "next_due", "pending", "skip_requested")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[str, dict[str, Any]] = {}
        #: Whether this step's update is to be skipped (``skip_step()``; the loop reads and
        #: clears it at the update, and clears it when a step begins).
        self.skip_requested = False
        #: Whether any request waits: the loop reads this one attribute after every step.
        self.pending = False
        #: Requests filed for the end of a later step (:meth:`request_later`), in step order.
        self._later: list[tuple[int, str, dict[str, Any]]] = []
        #: The step whose end files the next of them (a huge number: none waits).
        self.next_due = NEVER

    # -- asking ------------------------------------------------------------
    def request(self, kind: str, /, **values: Any) -> None:
        """File a request of ``kind`` (a name of :data:`KINDS`) carrying ``values``."""
        self._file((check_kind(kind), values))

    def request_later(self, step: int, kind: str, /, **values: Any) -> None:
        """File a request of ``kind`` when step ``step`` ends (a replayed live change): the
        loop's schedule visits that step's end and takes it with whatever else is filed."""
        check_kind(kind)
        with self._lock:
            self._later.append((int(step), kind, values))
            self._later.sort(key=lambda entry: entry[0])
            self.next_due = self._later[0][0]

    def cancel_later(self, kind: str) -> None:
        """Forget the requests of ``kind`` filed for later steps (a resume plans them anew)."""
        with self._lock:
            self._later = [entry for entry in self._later if entry[1] != kind]
            self.next_due = self._later[0][0] if self._later else NEVER

    def file_due(self, step: int) -> None:
        """File the requests meant for the end of ``step`` or earlier."""
        with self._lock:
            due = [entry for entry in self._later if entry[0] <= step]
            self._later = self._later[len(due) :]
            self.next_due = self._later[0][0] if self._later else NEVER
        for _, kind, values in due:
            self._file((kind, values))

    def request_all(self, asked: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """File several requests as one (a drain on the loop's thread sees all or none)."""
        self._file(*[(check_kind(kind), dict(values)) for kind, values in asked])

    def _file(self, *asked: tuple[str, dict[str, Any]]) -> None:
        with self._lock:  # one filing: a drain on the loop's thread sees all of it or none
            for kind, values in asked:
                mine = self._asked.setdefault(kind, {})
                for key, value in values.items():
                    mine.setdefault(key, value)
            self.pending = True

    def request_stop(self, reason: str = "stop requested", *, failed: bool = False) -> None:
        """Finish the current step, save (if checkpointing is on), and end training.

        ``failed=True`` marks the run as failed (a detector that found NaN or a
        divergence): it still saves, but exits with code 4 and shows as failed.
        """
        self._file(("stop", {"reason": str(reason)}), *((("failed", {}),) if failed else ()))

    def request_abort(self, reason: str = "abort requested", *, failed: bool = False) -> None:
        """End training after the current step without saving anything (``failed``: as above)."""
        self._file(("abort", {"reason": str(reason)}), *((("failed", {}),) if failed else ()))

    def request_rewind(
        self,
        since_step: int,
        *,
        reason: str = "rewind requested",
        skip_batches: int | None = None,
        lr_factor: float = 1.0,
        lr_steps: int = 0,
    ) -> None:
        """Roll back to the last checkpoint before step ``since_step`` (where a divergence
        began) and go on, skipping ``skip_batches`` batches from there (see
        :mod:`hookloop.checkpoint.rewind`). Acted on at the end of the current step,
        before a save."""
        request = RewindRequest(since_step, reason, skip_batches, lr_factor, lr_steps)
        self._file(("rewind", {"request": request}))

    def request_save(self) -> None:
        """Write a checkpoint at the end of the current step."""
        self._file(("save", {}))

    def request_evaluate(self) -> None:
        """Run an evaluation at the end of the current step."""
        self._file(("evaluate", {}))

    def request_log(self) -> None:
        """Fire the logging events at the end of the current step, even if not due."""
        self._file(("log", {}))

    def skip_step(self) -> None:
        """Do not apply this step's optimizer update (gradients are discarded)."""
        self.skip_requested = True

    # -- reading (for callbacks that coordinate) ---------------------------
    @property
    def stop_requested(self) -> bool:
        return "stop" in self._asked or "abort" in self._asked

    @property
    def abort_requested(self) -> bool:
        return "abort" in self._asked

    @property
    def log_requested(self) -> bool:
        """A log request is pending (the loop reads it when a step begins)."""
        return "log" in self._asked

    # -- draining (the loop's side) ----------------------------------------
    def take(self) -> Requests:
        """Return and clear every pending request of this process."""
        if not self.pending:
            return NO_REQUESTS
        with self._lock:
            asked, self._asked = self._asked, {}
            self.pending = False
        return Requests(asked)

    def take_skip(self) -> bool:
        """Whether this step's update is to be skipped (and forget the request)."""
        skip, self.skip_requested = self.skip_requested, False
        return skip

    def drain(
        self,
        *,
        signal: int | None = None,
        world_size: int = 1,
        device: Any = None,
        skipped: int = 0,
    ) -> Requests:
        """Take the pending requests and a caught ``signal`` (a stop), agreed across ranks.

        With several ranks, every rank returns the same answer: a request filed
        on any rank holds for all, and a stop or abort carries the reason the
        asking rank gave (:func:`agree`); ``skipped`` (the count of skipped updates) must be
        the same on every rank.
        """
        requests = self.take()
        if signal is not None:
            requests = requests.merge({"stop": {"reason": "signal"}, "signal": {"number": signal}})
        return requests if world_size == 1 else agree(requests, device, skipped=skipped)


@dataclass(frozen=True)
class RewindRequest:
    """What :meth:`Control.request_rewind` asks: roll back past ``since_step``, skip data."""

    since_step: int
    reason: str
    skip_batches: int | None = None
    lr_factor: float = 1.0
    lr_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.since_step, bool) or not isinstance(self.since_step, int):
            raise ValueError(f"since_step must be a step number >= 1, got {self.since_step!r}")
        if self.since_step < 1:
            raise ValueError(f"since_step must be a step number >= 1, got {self.since_step}")
        skip = self.skip_batches
        if skip is not None and (isinstance(skip, bool) or not isinstance(skip, int) or skip < 0):
            raise ValueError(f"skip_batches must be an int >= 0 or None, got {skip!r}")
        factor = self.lr_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ValueError(f"lr_factor must be a finite number > 0, got {factor!r}")
        if not 0 < factor < float("inf"):
            raise ValueError(f"lr_factor must be a finite number > 0, got {factor!r}")
        steps = self.lr_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"lr_steps must be an int >= 0, got {steps!r}")
