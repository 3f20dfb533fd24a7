"""What each callback handler costs: calls and wall time per (callback, event).

``CallbackManager.profile()`` swaps every handler in its dispatch index for a
timing wrapper made here, and ``profile(False)`` swaps the bare handlers back:
the dispatch path itself never checks whether profiling is on, so it costs
nothing when off. Times are inclusive (a handler that fires other events counts
their handlers too) and measured with ``time.perf_counter_ns``; the wrapper's
own cost, about 0.2 µs a call, is in them.

The table's share is each handler's time over the wall time since profiling
began (up to the report, or until it was switched off): for ``hookloop train
… callbacks.profile=true`` that is the whole ``train()``, so the column reads
as the part of the loop's time a handler takes.

The profile that runs is also published process-wide (:func:`current_profile`),
so the control server can serve it without reaching into the Trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Handler = Callable[[Any], Any]

_current: CallbackProfile | None = None


def current_profile() -> CallbackProfile | None:
    """The profile most recently started in this process and not yet stopped, or None."""
    return _current


def publish(profile: CallbackProfile | None, *, replacing: CallbackProfile | None = None) -> None:
    """Make ``profile`` the current one (``None`` clears it if ``replacing`` is current)."""
    global _current
    if profile is not None or _current is replacing:
        _current = profile


#: Column titles of :meth:`CallbackProfile.table`, in order.
COLUMNS = ("callback", "event", "calls", "total ms", "us/call", "share")


@dataclass
class HandlerCost:
    """One handler's counters: the callback's label, its event, calls and nanoseconds."""

    label: str
    event: str
    calls: int = 0
    ns: int = 0


class CallbackProfile:
    """The counters of one profiling session, filled in while handlers run."""

    def __init__(self) -> None:
        self._costs: dict[tuple[int, str], HandlerCost] = {}
        self.started_ns = time.perf_counter_ns()
        self.stopped_ns: int | None = None

    def wrap(self, key: int, label: str, event: str, call: Handler) -> Handler:
        """A handler that counts and times ``call`` into this profile (keyed by registration)."""
        cost = self._costs.get((key, event))
        if cost is None:
            cost = self._costs[(key, event)] = HandlerCost(label, event)
        clock = time.perf_counter_ns

        def timed(ctx: Any) -> Any:
            start = clock()
            try:
                return call(ctx)
            finally:
                cost.ns += clock() - start
                cost.calls += 1

        timed.__wrapped__ = call  # type: ignore[attr-defined]  # as functools.wraps sets it
        timed.__qualname__ = getattr(call, "__qualname__", repr(call))
        return timed

    def stop(self) -> None:
        if self.stopped_ns is None:
            self.stopped_ns = time.perf_counter_ns()

    @property
    def elapsed_s(self) -> float:
        """Wall seconds profiled: since it began, up to now or until it was stopped."""
        end = self.stopped_ns if self.stopped_ns is not None else time.perf_counter_ns()
        return (end - self.started_ns) / 1e9

    def rows(self) -> list[dict[str, Any]]:
        """One dict per handler that ran, most total time first (JSON-ready)."""
        elapsed_ns = max(self.elapsed_s * 1e9, 1.0)
        costs = sorted(
            (c for c in list(self._costs.values()) if c.calls),
            key=lambda c: (-c.ns, c.label, c.event),
        )
        return [
            {
                "callback": c.label,
                "event": c.event,
                "calls": c.calls,
                "total_ms": round(c.ns / 1e6, 3),
                "us_per_call": round(c.ns / c.calls / 1e3, 2),
                "share": round(c.ns / elapsed_ns, 5),
            }
            for c in costs
        ]

    def cost(self, label: str, event: str) -> HandlerCost:
        """The summed counters of every handler of ``label`` for ``event``."""
        total = HandlerCost(label, event)
        for c in self._costs.values():
            if c.label == label and c.event == event:
                total.calls += c.calls
                total.ns += c.ns
        return total

    def table(self) -> str:
        """The report as a plain text table (``hookloop train`` prints it at the end)."""
        rows = self.rows()
        cells = [list(COLUMNS)]
        for r in rows:
            cells.append(
                [
                    r["callback"],
                    r["event"],
                    str(r["calls"]),
                    f"{r['total_ms']:.2f}",
                    f"{r['us_per_call']:.1f}",
                    f"{r['share']:.2%}",
                ]
            )
        widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]

        def line(row: list[str]) -> str:
            left = [row[i].ljust(widths[i]) for i in range(2)]
            right = [row[i].rjust(widths[i]) for i in range(2, len(COLUMNS))]
            return "  ".join(left + right).rstrip()

        total_ms = sum(r["total_ms"] for r in rows)
        head = (
            f"callback cost over {self.elapsed_s:.2f} s of wall time: "
            f"{total_ms:.1f} ms in handlers ({total_ms / 1e3 / max(self.elapsed_s, 1e-9):.1%})"
        )
        if not rows:
            return head + "\n(no handler ran)"
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([head, line(cells[0]), rule, *(line(row) for row in cells[1:])])
