"""SIGINT and SIGTERM during a study: held while its storage is written, raised where a
trial can be cut cleanly (:class:`Interrupts`), then the cut trial is queued again."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class StudyInterrupted(BaseException):
    """SIGINT or SIGTERM stopped the study; the trial it cut is FAIL and queued again."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Interrupts:
    """SIGINT and SIGTERM stop the study (main thread only).

    A signal is held while the study's storage is being written (claiming or recording a
    trial) and raised as :class:`StudyInterrupted` at the next safe point: while waiting,
    or while a trial is being set up. During training the Trainer's own handlers take
    over: it finishes the step, saves a checkpoint and returns, and the trial is recorded
    FAIL (interrupted) and queued again to resume from that checkpoint.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self.interruptible = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pending is None:
            self.pending = signum
            if self.interruptible:
                raise StudyInterrupted(signum)

    def check(self) -> None:
        if self.pending is not None:
            raise StudyInterrupted(self.pending)

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """A stretch where a signal may raise at once."""
        self.check()
        self.interruptible = True
        try:
            yield
        finally:
            self.interruptible = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._handle) for s in signals}
        # Nested inside another's (the command's, installed first thing): a signal that came
        # before this took over is this one's, and one held here is the outer's afterwards.
        outer = getattr(previous[signal.SIGTERM], "__self__", None)
        outer = outer if isinstance(outer, Interrupts) else None
        if outer is not None and self.pending is None:
            self.pending = outer.pending
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if outer is not None and outer.pending is None:
                outer.pending = self.pending
