"""``hookloop train`` as torchrun runs it, with an optional injected fault (not collected).

``HOOKLOOP_TEST_KILL_AT=RANK:STEP`` makes that rank SIGKILL itself at the end of
that step, on the first attempt only (torchrun counts attempts in
``TORCHELASTIC_RESTART_COUNT``), the way a node lost mid-run dies: no handler,
no clean-up. Everything else is the real command line.
"""

from __future__ import annotations

import os
import signal
import sys

from hookloop.app import cli
from hookloop.callback import Callback
from hookloop.callbacks import defaults


class KillAt(Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.rank == self.rank and ctx.state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    fault = os.environ.get("HOOKLOOP_TEST_KILL_AT")
    if fault and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        rank, step = (int(part) for part in fault.split(":"))
        standard = defaults.default_callbacks
        defaults.default_callbacks = lambda cfg, run_dir: [
            *standard(cfg, run_dir),
            KillAt(rank, step),
        ]
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
