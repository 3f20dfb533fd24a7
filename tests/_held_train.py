"""``python tests/_held_train.py STEP ARGS...``: ``hookloop ARGS...`` that stops moving at STEP.

A test that SIGKILLs a run once the run has logged some step watches the run's files
from its own process, and on a loaded machine that process can be descheduled long
enough for a small run to finish first. Here the run, once it has logged STEP, sleeps
until it is killed; a kill aimed at any earlier step still lands wherever the run has got
to by then, but always inside training. Nothing else about the run changes: the added
callback keeps no state and sits after every built-in one.
"""

from __future__ import annotations

import sys
import time

import hookloop.callbacks.defaults as defaults
from hookloop import Callback
from hookloop.cli import main


class HoldAt(Callback):
    """Sleep in ``on_log`` from ``step`` on: the step's record is handed to the log writer
    first (every built-in logger runs earlier), and the writer flushes it while this sleeps."""

    priority = 10_000

    def __init__(self, step: int) -> None:
        self.step = step

    def on_log(self, ctx) -> None:
        if ctx.state.step >= self.step:
            while True:
                time.sleep(60)


def _with_hold(step: int):
    built_in = defaults.default_callbacks

    def default_callbacks(*args, **kwargs):
        return [*built_in(*args, **kwargs), HoldAt(step)]

    return default_callbacks


if __name__ == "__main__":
    defaults.default_callbacks = _with_hold(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
