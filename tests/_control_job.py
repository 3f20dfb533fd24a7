"""A real training process with the control server, for tests/test_control*.py.

    python tests/_control_job.py OUT_DIR JOB_ID [--sleep S] [KEY=VALUE ...]

Trains the mlp-regression recipe (CPU, one thread) with a ControlServer and
a JsonLogger writing OUT_DIR/metrics.jsonl; evaluation only on request.
``--sleep`` pauses after every step so that a long-running job leaves the
shared CPU to the test. Registers under $HOOKLOOP_JOBS_DIR. Ends like
``hookloop train``: the stop reason on stderr, the trainer's exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hookloop import Callback
from hookloop.callbacks import JsonLogger
from hookloop.config import apply_overrides
from hookloop.control import ControlServer
from hookloop.entry import build_trainer
from hookloop.recipes import default_config


def register_note(out: Path) -> None:
    """A command that carries a value, as a user adds one: ``note {"text": ...}`` writes
    the text and the step it was acted on at to ``OUT/notes.jsonl``."""
    from hookloop.control import Command, CommandError, register_command
    from hookloop.loop.actions import register_action
    from hookloop.requests import register_kind

    def check(values) -> None:
        text = values["text"]
        if not isinstance(text, str) or not 0 < len(text) <= 100:
            raise CommandError(f"note: text must be a string of 1 to 100 characters, got {text!r}")

    def note(trainer, values) -> None:
        with (out / "notes.jsonl").open("a") as f:
            f.write(json.dumps({"step": trainer.state.step, "text": values["text"]}) + "\n")

    register_kind("note", "write a note with the step it was acted on at")
    register_action("note", note)
    register_command(
        "note",
        Command(
            "write a note at the end of the current step",
            lambda values: [("note", {"text": values["text"]})],
            takes=("text",),
            check=check,
        ),
    )


class _Pause(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_step_end(self, ctx) -> None:
        time.sleep(self.seconds)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("job_id")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()  # overrides may follow --sleep
    torch.set_num_threads(1)
    cfg = default_config("mlp-regression")
    apply_overrides(
        cfg,
        [
            "train.device=cpu",
            "train.max_steps=1000000",
            "train.eval_every=null",
            "train.eval_at_epoch_end=false",
            "train.log_every=10",
            "logging.progress=false",
            *args.overrides,
        ],
    )
    out = Path(args.out)
    register_note(out)
    callbacks = [
        ControlServer(job_id=args.job_id, required=True),
        JsonLogger(out / "metrics.jsonl"),
    ]
    if args.sleep > 0:
        callbacks.append(_Pause(args.sleep))
    trainer = build_trainer(cfg, callbacks=callbacks, out_dir=out)
    if cfg.callbacks.profile:  # as hookloop train does: the cost report in the status
        trainer.callbacks.profile()
    result = trainer.train()
    print(f"hookloop: {result.stop_reason} at step {result.step}", file=sys.stderr, flush=True)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
