"""Timing helpers shared by the benchmarks in this folder.

The machines these run on are shared and noisy (speed drifts by tens of
percent within seconds), so every benchmark here follows the same rules:

- measure large batches with ``time.perf_counter_ns``;
- interleave the contenders within each round, and repeat many rounds;
- compare contenders *within* a round (paired differences or ratios), then
  report the median over rounds, which shrugs off the odd slow round;
- read two clocks at once (:func:`now`): wall time (``perf_counter_ns``) and the
  process's CPU time (``process_time_ns``). When the machine runs more busy
  processes than it has cores, wall time also counts the slices spent waiting
  for a core, which land at random on one contender or another; CPU time does
  not, so it is usually the steadier of the two. Both are reported.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

CLOCKS = ("wall", "cpu")


class Stamp(NamedTuple):
    """A reading of both clocks, in nanoseconds; subtracting two gives a duration."""

    wall: int
    cpu: int

    def __sub__(self, other: object) -> Stamp:  # type: ignore[override]
        if not isinstance(other, Stamp):
            return NotImplemented
        return Stamp(self.wall - other.wall, self.cpu - other.cpu)


def now() -> Stamp:
    """Both clocks; usable as ``timeit.Timer(timer=now)``, whose result is then a Stamp."""
    return Stamp(time.perf_counter_ns(), time.process_time_ns())


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles (equal to the value itself for one sample)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect now, then keep the cyclic garbage collector off inside the block."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_ns(fn: Callable[[], Any]) -> Stamp:
    """Wall and CPU nanoseconds of one call of ``fn``."""
    start = now()
    fn()
    return now() - start


def shuffled(items: Sequence[Any], rng: random.Random) -> list[Any]:
    """A shuffled copy: a fresh order each round, so no case always runs first."""
    out = list(items)
    rng.shuffle(out)
    return out


def verdict(value: float, limit: float) -> str:
    return "ok" if value <= limit else "MISS"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain monospace table: first column left-aligned, the others right-aligned.

    Rows shorter than ``headers`` are padded with empty cells.
    """
    width = len(headers)
    cells = [[str(h) for h in headers]]
    cells += [[str(c) for c in row] + [""] * (width - len(row)) for row in rows]  # pad short rows
    widths = [max(len(row[i]) for row in cells) for i in range(width)]

    def line(row: Sequence[str]) -> str:
        parts = [
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def environment(extra: str = "") -> str:
    """One line saying what these numbers were measured on."""
    parts = [
        f"python {platform.python_version()} ({sys.implementation.name})",
        f"{platform.machine()}",
        f"{os.cpu_count()} cpus",
    ]
    try:
        import torch

        parts.append(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    except ImportError:  # pragma: no cover - torch is a hookloop dependency
        pass
    if extra:
        parts.append(extra)
    return "; ".join(parts)
