"""``python tests/_held_train.py STEP ARGS...``: ``hookloop ARGS...`` that holds still at STEP.

A test that signals a run once the run has logged some step watches the run's files from
its own process, and on a loaded machine that process can be descheduled long enough for
a small run to finish first. Here the run, once it has logged STEP, waits until a signal
reaches it: a SIGKILL ends it there, and a SIGTERM or SIGINT (which hookloop's handler
turns into a stop at the next step boundary) lets it go on to that stop. A signal that
came earlier does not hold it at all. Nothing else about the run changes: the added
callback keeps no state and runs after every built-in one.
"""

from __future__ import annotations

import signal
import sys
import time

import hookloop.callbacks.defaults as defaults
from hookloop import Callback
from hookloop.app.cli import main


class HoldAt(Callback):
    """Wait in ``on_log`` at ``step`` for a signal. The step's record has been handed to
    the log writer by then (every built-in logger runs earlier), which writes it out while
    this waits."""

    priority = 10_000

    def __init__(self, step: int) -> None:
        self.step = step
        self.signalled = False

    def on_train_start(self, ctx) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):  # hookloop's handlers are in place
            signal.signal(signum, self._noting(signal.getsignal(signum)))

    def _noting(self, handler):
        def note_then_handle(signum, frame):
            self.signalled = True
            if callable(handler):
                handler(signum, frame)

        return note_then_handle

    def on_log(self, ctx) -> None:
        if ctx.state.step == self.step:
            while not self.signalled:
                time.sleep(0.005)


def _with_hold(step: int):
    built_in = defaults.default_callbacks

    def default_callbacks(*args, **kwargs):
        return [*built_in(*args, **kwargs), HoldAt(step)]

    return default_callbacks


if __name__ == "__main__":
    defaults.default_callbacks = _with_hold(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
