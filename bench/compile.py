"""Training steps per second, eager against ``train.compile=true``, on the default recipe.

The recipe is ``hookloop train``'s default (``gpt-stdlib``: a byte-level GPT,
4 layers, width 128, context 128, batch 32, AdamW, grad clipping) with its own
config, except: no evaluation, no checkpoints, no callbacks but a clock. Each
round trains a fresh Trainer eagerly and one compiled, in a random order, for
``--warmup`` + ``--steps`` steps. The first ``--warmup`` steps hold the
compilation (cold in the first round, from Inductor's on-disk cache after it)
and are reported apart; steady-state step time is the median over the last
``--steps`` steps of a run, and ``x eager`` is compiled over eager within a round.

    python bench/compile.py                # 3 rounds of 5 + 20 steps each
    python bench/compile.py --quick        # 1 round of 3 + 8 steps
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _timing import environment, format_table, median, shuffled
from hookloop import Callback
from hookloop.entry import build_trainer
from hookloop.recipes import default_config

MODES = ("eager", "compiled")


class StepClock(Callback):
    """Wall time at the end of every training step."""

    def __init__(self) -> None:
        self.start = 0.0
        self.ends: list[float] = []

    def on_train_start(self, ctx) -> None:
        self.start = time.perf_counter()

    def on_train_step_end(self, ctx) -> None:
        self.ends.append(time.perf_counter())


def run(mode: str, warmup: int, steps: int) -> tuple[float, float]:
    """(seconds for the first ``warmup`` steps, median seconds per step after them)."""
    cfg = default_config("gpt-stdlib")
    cfg.train.max_steps = warmup + steps
    cfg.train.eval_every = None
    cfg.train.eval_at_epoch_end = False
    cfg.train.log_every = 10
    cfg.train.handle_signals = False
    cfg.train.compile = mode == "compiled"
    cfg.checkpoint.every = None
    clock = StepClock()
    trainer = build_trainer(cfg, callbacks=[clock])
    trainer.train()
    ends = [clock.start, *clock.ends]
    per_step = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False)]
    return ends[warmup] - ends[0], statistics.median(per_step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=5, help="steps holding compilation")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 + 8 steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round order")
    args = parser.parse_args(argv)
    rounds, warmup, steps = (1, 3, 8) if args.quick else (args.rounds, args.warmup, args.steps)
    if rounds < 1 or warmup < 1 or steps < 2:
        parser.error("--rounds and --warmup must be >= 1 and --steps >= 2")
    rng = random.Random(args.seed)
    first: dict[str, list[float]] = {m: [] for m in MODES}
    step: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in shuffled(MODES, rng):
            warm_s, step_s = run(mode, warmup, steps)
            first[mode].append(warm_s)
            step[mode].append(step_s)
    ratios = [c / e for c, e in zip(step["compiled"], step["eager"], strict=True)]
    rows = []
    for mode in MODES:
        ms = median(step[mode]) * 1e3
        rows.append(
            [
                mode,
                f"{ms:.1f}",
                f"{1e3 / ms:.2f}",
                f"{median(ratios) if mode == 'compiled' else 1.0:.3f}",
                f"{first[mode][0]:.1f}",
                f"{median(first[mode][1:]) if rounds > 1 else float('nan'):.1f}",
            ]
        )
    table = format_table(
        [
            "mode",
            "ms/step",
            "steps/s",
            "x eager",
            f"first {warmup} steps, s (cold)",
            "(later rounds)",
        ],
        rows,
    )
    print(
        f"hookloop train.compile on gpt-stdlib: {rounds} round(s) of {warmup} + {steps} "
        "steps per mode (medians)"
    )
    print(environment(f"device {'cuda' if torch.cuda.is_available() else 'cpu'}"))
    print()
    print(table)
    print()
    print("x eager: compiled step time / eager step time within a round, then the median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
