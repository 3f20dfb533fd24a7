"""Named stopwatches in Megatron's shape: ``timers("forward-backward").start()``.

The loop fills a few of them (see :data:`LOOP_TIMERS`) and callbacks read them
as ``ctx.state.timers``; callbacks and forward steps may add their own. A timer
adds up the time between each ``start()`` and ``stop()``.

They read the host clock only. On a GPU that is the time to *queue* the work,
not to run it, unless the device is waited for: ``Timers(sync=True)``
(``train.timers=sync``) synchronises the device at every start and stop, and
``start(barrier=True)`` / ``stop(barrier=True)`` also wait for every rank
first, as Megatron's do. Both cost a host-device round trip, so neither is the default.

>>> timers = Timers()
>>> with timers("setup"):
...     pass
>>> timers("setup").elapsed(reset=False) >= 0.0, timers.names()
(True, ['setup'])
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

#: The timers the training loop fills, and what each one covers.
LOOP_TIMERS = {
    "data-iterator": "fetching the step's micro-batches from the data",
    "forward-backward": "forward, loss and backward of every micro-batch of the step",
    "optimizer": "unscale, clip, finiteness check, optimizer and scheduler step, zero_grad",
    "eval": "evaluations run during training",
    "checkpoint-save": "writing checkpoints (as long as training is blocked)",
}


def _wait(device: Any, barrier: bool) -> None:
    """Wait for every rank (``barrier``) and for the device's queued work."""
    import torch

    if barrier and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    if device is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """A stopwatch that adds up the time of each ``start()`` … ``stop()`` interval.

    Also a context manager: ``with timers("x"): ...``.
    """

    __slots__ = ("_device", "_elapsed", "_started", "_sync", "count", "name")

    def __init__(self, name: str, *, sync: bool = False, device: Any = None) -> None:
        self.name = name
        self.count = 0  # intervals completed since the last reset
        self._elapsed = 0.0
        self._started: float | None = None
        self._sync = sync
        self._device = device

    @property
    def active(self) -> bool:
        """Whether the timer is running."""
        return self._started is not None

    def start(self, barrier: bool = False) -> None:
        """Start timing; ``barrier`` first waits for every rank and the device."""
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} is already running; stop() it first")
        if barrier or self._sync:
            _wait(self._device, barrier)
        self._started = perf_counter()

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the interval; ``barrier`` as for :meth:`start`."""
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} is not running; start() it first")
        if barrier or self._sync:
            _wait(self._device, barrier)
        self._elapsed += perf_counter() - self._started
        self._started = None
        self.count += 1

    def add(self, seconds: float, intervals: int = 1) -> None:
        """Add ``seconds`` measured elsewhere, as ``intervals`` completed intervals (the
        loop reads one clock per step boundary and hands each timer its share, instead of
        a start and a stop)."""
        self._elapsed += seconds
        self.count += intervals

    def reset(self) -> None:
        """Forget the time added up so far (and stop a running timer)."""
        self._elapsed = 0.0
        self._started = None
        self.count = 0

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds added up so far (a running timer counts up to now), then reset by default.

        A running timer keeps running; with ``reset`` it starts counting afresh from now.
        """
        total = self._elapsed
        if self._started is not None:
            if barrier or self._sync:
                _wait(self._device, barrier)
            now = perf_counter()
            total += now - self._started
            if reset:
                self._started = now
        if reset:
            self._elapsed = 0.0
            self.count = 0
        return total

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.active else "stopped"
        return f"Timer({self.name!r}, {self._elapsed:.6f} s, {state})"


class NullTimer:
    """What the loop times with when timers are off: start and stop do nothing."""

    __slots__ = ()

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def add(self, seconds: float, intervals: int = 1) -> None:
        pass


NULL_TIMER = NullTimer()


def loop_clock(mode: str, device: Any = None) -> Callable[[], float]:
    """The clock the loop reads at each step boundary for ``train.timers=mode``.

    ``on``: the host clock; ``sync``: waits for ``device``'s queued work first;
    ``off``: always 0.0 (the loop's timers are :data:`NULL_TIMER` then).
    """
    if mode == "off":
        return _no_clock
    if mode == "sync":

        def synced_clock() -> float:
            _wait(device, False)
            return perf_counter()

        return synced_clock
    return perf_counter


def _no_clock() -> float:
    return 0.0


class Timers:
    """Named timers, made on first use: ``timers("forward-backward")``.

    ``sync=True`` makes every timer wait for ``device`` at each start and stop,
    so that device work is counted where it runs, not where it is queued.
    """

    def __init__(self, *, sync: bool = False, device: Any = None) -> None:
        if not isinstance(sync, bool):
            raise TypeError(f"sync must be a bool, got {sync!r}")
        self.sync = sync
        self.device = device
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        """The timer called ``name`` (``log_level`` is accepted for Megatron's signature)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a timer name must be a non-empty str, got {name!r}")
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name, sync=self.sync, device=self.device)
        return timer

    def __contains__(self, name: object) -> bool:
        return name in self._timers

    def names(self) -> list[str]:
        """Every timer made so far, in the order they were first used."""
        return list(self._timers)

    def elapsed(self, reset: bool = True) -> dict[str, float]:
        """Seconds of every timer that ran since the last reset, by name."""
        return {
            name: t.elapsed(reset=reset) for name, t in self._timers.items() if t.count or t.active
        }

    def reset(self) -> None:
        for timer in self._timers.values():
            timer.reset()

    def __repr__(self) -> str:
        return f"Timers({', '.join(self._timers)})"


def per_step_ms(timers: Timers, steps: int) -> dict[str, float]:
    """``timers/<name>``: milliseconds per step of each timer that ran since the last call.

    Resets the timers it reads (each log covers the steps since the one before).
    """
    steps = max(steps, 1)
    return {f"timers/{name}": 1e3 * s / steps for name, s in timers.elapsed(reset=True).items()}
