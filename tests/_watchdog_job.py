"""A two-rank job whose rank 1 hangs at step 3, for tests/test_watchdog.py (not collected).

    python tests/_watchdog_job.py MODE OUT [KEY=VALUE ...]

with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set per rank. MODE ``stop``: rank 1
stops itself (SIGSTOP) in a callback (``stop-rank-0``: rank 0 does); ``loop``: rank 1
loops forever in a callback; ``plain``: nobody hangs, but rank 0's ``on_train_end``
outlasts the watchdog's deadline after rank 1 is done. Each rank that returns from
training writes ``result-rankN.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from hookloop import Callback, CallbackContext
from hookloop.config import apply_overrides
from hookloop.control.cli import format_status
from hookloop.control.client import JobClient
from hookloop.control.registry import find_job
from hookloop.control.server import ControlServer
from hookloop.distributed import init_from_env, leave_process_group, rank_info
from hookloop.entry import build_trainer
from hookloop.recipes import default_config

HANG_STEP = 3


class StopAtStep(Callback):
    """Rank ``rank`` stops itself at step 3: after a pause, so a heartbeat records where it
    is (a real stop comes at any time; the beat before it is what the others are shown)."""

    def __init__(self, pause: float, rank: int = 1) -> None:
        self.pause, self.rank = pause, rank

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if ctx.state.rank == self.rank and ctx.state.step == HANG_STEP:
            time.sleep(self.pause)
            os.kill(os.getpid(), signal.SIGSTOP)


def spin_forever() -> int:
    """A callback's own bug: a loop that never ends."""
    turns = 0
    while True:
        turns += 1


class LoopAtStep(Callback):
    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if ctx.state.rank == 1 and ctx.state.step == HANG_STEP:
            spin_forever()


class SlowEnd(Callback):
    """Rank 0 ends training long after rank 1 is done; meanwhile it reads its own status
    the way ``hookloop ctl JOB status`` does, until it shows rank 1 finished."""

    def __init__(self, seconds: float, out: str) -> None:
        self.seconds, self.out = seconds, out

    def on_train_end(self, ctx: CallbackContext) -> None:
        if ctx.state.rank != 0:
            return
        until = time.monotonic() + self.seconds
        client = JobClient.from_record(find_job(f"watchdog-{os.getpid()}"))
        status = client.status()
        while time.monotonic() < until and not _shows_rank_1_finished(status):
            time.sleep(0.1)
            status = client.status()
        shown = {"ranks": status.get("ranks"), "text": format_status(status)}
        Path(self.out, "status.json").write_text(json.dumps(shown))
        time.sleep(max(0.0, until - time.monotonic()))


def _shows_rank_1_finished(status: dict) -> bool:
    return any(row["rank"] == 1 and row["state"] == "finished" for row in status["ranks"] or [])


def main() -> None:
    mode, out, *overrides = sys.argv[1:]
    init_from_env()
    rank, _, _ = rank_info()
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, ["data.batch_size=16", "train.max_steps=8", *overrides])
    trainer = build_trainer(cfg, out_dir=out)
    deadline = float(cfg.train.watchdog_seconds)
    hang = {
        "stop": StopAtStep(pause=deadline * 2 / 3),
        "stop-rank-0": StopAtStep(pause=deadline * 2 / 3, rank=0),  # the store's host
        "loop": LoopAtStep(),
    }
    if mode == "plain":
        trainer.callbacks.add([ControlServer(job_id=f"watchdog-{os.getpid()}", required=True),
                               SlowEnd(seconds=deadline * 2, out=out)])  # fmt: skip
    else:
        trainer.callbacks.add(hang[mode])
    result = trainer.train()
    Path(out, f"result-rank{rank}.json").write_text(json.dumps({"step": result.step}))
    leave_process_group()


if __name__ == "__main__":
    main()
