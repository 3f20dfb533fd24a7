"""``GlobalState``: what the seed's forward steps and callbacks receive as ``state``.

It is a view, not a second copy of the run's progress: ``train_state`` reads the
native :class:`hookloop.TrainState` that the loop keeps, so the numbers can never
disagree with what native callbacks see.

>>> from hookloop import Config
>>> state = GlobalState(Config())
>>> state.train_state.step, state.train_state.consumed_train_samples
(0, 0)
>>> timer = state.timers("forward")
>>> timer.start(); timer.stop()
>>> timer.elapsed() >= 0.0
True
"""

from __future__ import annotations

import time
from typing import Any

from hookloop.state import TrainState


class TrainStateView:
    """The seed's ``train_state``: progress counters under the seed's names, read-only."""

    __slots__ = ("_native",)

    def __init__(self, native: TrainState) -> None:
        self._native = native

    @property
    def step(self) -> int:
        """Optimizer steps begun (during step N's events it is N)."""
        return self._native.step

    @property
    def consumed_train_samples(self) -> int:
        """Training samples consumed so far, over all ranks."""
        return self._native.samples

    @property
    def floating_point_operations_so_far(self) -> float:
        """Estimated training FLOPs so far (0 when the recipe gives no estimate)."""
        return self._native.flops

    def __repr__(self) -> str:
        return (
            f"TrainStateView(step={self.step}, "
            f"consumed_train_samples={self.consumed_train_samples})"
        )


class Timer:
    """A stopwatch that adds up the time between each ``start()`` and ``stop()``."""

    __slots__ = ("_elapsed", "_started", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._elapsed = 0.0
        self._started: float | None = None

    def start(self, barrier: bool = False) -> None:
        """Start timing; ``barrier`` is accepted for the seed's signature and ignored."""
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} is already running; stop() it first")
        self._started = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} is not running; start() it first")
        self._elapsed += time.perf_counter() - self._started
        self._started = None

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = None

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds timed so far (a running timer counts up to now); then reset by default."""
        total = self._elapsed
        if self._started is not None:
            now = time.perf_counter()
            total += now - self._started
            self._started = now if reset else self._started
        if reset:
            self._elapsed = 0.0
        return total


class Timers:
    """Named timers, created on first use: ``timers("forward").start()``."""

    def __init__(self) -> None:
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        """The timer called ``name``; ``log_level`` is accepted for the seed's signature."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a timer name must be a non-empty str, got {name!r}")
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name)
        return timer

    def names(self) -> list[str]:
        """Every timer used so far, in first-use order."""
        return list(self._timers)


class GlobalState:
    """``cfg`` (the run's :class:`hookloop.Config`), ``train_state`` and ``timers``.

    One is shared by the forward step and the callbacks of a run. Until the loop
    starts, ``train_state`` shows a fresh run (all counters zero).
    """

    def __init__(self, cfg: Any, train_state: TrainState | None = None) -> None:
        self.cfg = cfg
        self.timers = Timers()
        self._train_state = TrainStateView(train_state if train_state is not None else TrainState())

    @property
    def train_state(self) -> TrainStateView:
        return self._train_state

    def attach(self, native: TrainState) -> None:
        """Follow the counters of ``native`` (the trainer's state) from now on."""
        self._train_state._native = native

    def __repr__(self) -> str:
        return f"GlobalState(train_state={self._train_state!r})"
