"""A two-rank job whose rank 1 hangs at step 3, for tests/test_watchdog.py (not collected).

    python tests/_watchdog_job.py MODE OUT [KEY=VALUE ...]

with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set per rank. MODE ``stop``: rank 1
stops itself (SIGSTOP) in a callback (``stop-rank-0``: rank 0 does); ``loop``: rank 1
loops forever in a callback; ``plain``: nobody hangs, but rank 0's ``on_train_end``
outlasts the watchdog's deadline after rank 1 is done. Each rank that returns from
training writes ``result-rankN.json``.

MODE ``forged`` (no environment, one process): rank 0's watchdog of three ranks whose
other two this process plays through a client of its store (:func:`forged`).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from hookloop import Callback, CallbackContext
from hookloop.config import apply_overrides
from hookloop.control.cli import format_status
from hookloop.control.client import JobClient
from hookloop.control.registry import find_job
from hookloop.control.server import ControlServer
from hookloop.distributed import init_from_env, leave_process_group, rank_info
from hookloop.entry import build_trainer
from hookloop.recipes import default_config
from hookloop.rundir import RunDir
from hookloop.state import Progress
from hookloop.watchdog import PREFIX, STORE_TIMEOUT, Watchdog, rank_beats
from hookloop.watchdog_beats import encode_beat

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


#: A beat of rank 1 as JSON, for the forged values below to vary.
RANK_1 = (
    b'{"rank": 1, "host": "n", "pid": 1, "step": 3, "event": null, "callback": null, '
    b'"collective": null, "frame": null, "time": 0.0, "seq": 1, "state": "running", '
    b'"deadline": 3.0, "still_s": 0.0, "stuck_s": 0.0, "stack": null}'
)
#: Planted under rank 1's key between its beats, each left until rank 0 shows it refused.
FORGED = [
    b"<html>502 Bad Gateway</html>",
    b"<html>504 Gateway Timeout</html>",  # the same reason: not said again
    b"x" * (1 << 20),
    RANK_1.replace(b'"rank": 1', b'"rank": 0').replace(b'"running"', b'"finished"'),
    RANK_1.replace(b'"deadline": 3.0', b'"deadline": 1e999'),  # JSON for inf
    RANK_1.replace(b'"running"', b'"zombie"'),
]
#: Rank 2's texts: escape sequences that would retitle, clear and recolour a terminal.
ESCAPES = {
    "host": "node\x1b]0;owned\x07\x1b[2J7", "event": "on_log", "callback": "Up\x1b[1Aload",
    "stack": '  File "cb.py", line 3, in upload\x1b[31m\n    spin()\n',
}  # fmt: skip


def forged(out: str, deadline: float = 3.0) -> None:
    """Rank 0's watchdog of three ranks; ranks 1 and 2 are played here through a client of
    its store. Rank 1 beats, with :data:`FORGED` values planted between its beats; rank 2
    beats with :data:`ESCAPES` in its texts, then falls silent: rank 0's watchdog names
    it and ends this process with code 5 (rank 1 reads the verdict, as its watchdog would)."""
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, timeout=STORE_TIMEOUT,
                          wait_for_workers=False)  # fmt: skip
    for rank in range(3):
        store.set(f"{PREFIX}/beat/{rank}", "null")
    progress = Progress()
    progress.place(0, 0, 3)
    Watchdog(progress, deadline, RunDir(out), beat_seconds=0.1).start(store)
    peers = dist.TCPStore("127.0.0.1", store.port, 3, is_master=False, timeout=STORE_TIMEOUT)
    seq = itertools.count(1)

    def beat(rank: int) -> None:
        fields = ESCAPES if rank == 2 else {}
        peers.set(f"{PREFIX}/beat/{rank}", encode_beat({
            "rank": rank, "host": "node1", "pid": 4000 + rank, "step": 3, "event": None,
            "callback": None, "collective": None, "frame": None, "time": time.time(),
            "seq": next(seq), "state": "running", "deadline": deadline, "still_s": 0.0,
            "stuck_s": 0.0, "stack": None, **fields,
        }))  # fmt: skip

    def until(done: Callable[[], bool], beating: tuple[int, ...]) -> None:
        for _ in range(3000):  # a minute: never reached while the watchdog works
            for rank in beating:
                beat(rank)
            if done():
                return
            time.sleep(0.02)
        raise SystemExit(f"rank 0's watchdog never showed it; its table: {rank_beats()}")

    def row(rank: int) -> dict:
        rows = rank_beats() or []
        return rows[rank] if len(rows) > rank else {}

    until(lambda: row(1).get("state") == row(2).get("state") == "running", beating=(1, 2))
    Path(out, "rows.json").write_text(json.dumps(rank_beats()))
    for value in FORGED:
        peers.set(f"{PREFIX}/beat/1", value)
        until(lambda: "refused" in row(1), beating=(2,))
        until(lambda: "refused" not in row(1) and row(1).get("state") == "running", beating=(1, 2))
    read = f"{PREFIX}/read/2"
    until(lambda: peers.check([read]), beating=(1,))  # rank 2 fell silent; rank 0 named it
    peers.add(read, 1)
    until(lambda: False, beating=(1,))  # rank 0's watchdog ends the process


def main() -> None:
    mode, out, *overrides = sys.argv[1:]
    if mode == "forged":
        forged(out)
        return
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
