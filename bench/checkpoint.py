"""How long training is blocked by each checkpoint save: synchronous vs asynchronous.

The default recipe (``gpt-stdlib``: its model, AdamW, data and schedule), with
``checkpoint.every=2`` over ``--steps`` steps, trained once with
``checkpoint.async_save=false`` and once with ``=true`` in each round (in a fresh
random order), each run into a fresh temporary run directory. Every save reports
its :class:`~hookloop.state.SaveTiming` through ``on_checkpoint_save``:
``blocked_seconds`` (the time the loop waited: the whole save when synchronous;
the copy to host memory, plus any wait for the previous save, when
asynchronous) and ``seconds`` (start of the save to the end of its commit).
The bench also reads the loop thread's CPU time inside ``save_checkpoint()``
(``time.thread_time``), which a busy machine disturbs less than wall time.

The save at the last step is left out of the figures: ``train()`` waits for it
before returning, so it blocks for its full length in both modes by design.
Per round, the ratio is the median async blocked time over the median sync
save; the table shows medians over rounds and the IQR. The first asynchronous
save of a run also allocates the host buffers that later saves refill, so the
table shows the later saves apart as well.

    python bench/checkpoint.py              # 10 rounds of 10 steps
    python bench/checkpoint.py --quick      # 3 rounds of 6 steps
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import environment, format_table, median, quartiles, shuffled, verdict
from hookloop.entry import build_trainer
from hookloop.recipes import get_recipe

TARGET = 0.10  # async blocked time per save, as a fraction of the synchronous save
MODES = ("sync", "async")


def one_run(steps: int, async_save: bool, root: Path) -> tuple[list[tuple[float, ...]], float]:
    """Train the default recipe; return each save's (blocked, seconds, loop CPU) and the
    train() wall time."""
    cfg = get_recipe("gpt-stdlib").default_config()
    cfg.train.max_steps = steps
    cfg.train.log_every = 0
    cfg.train.eval_every = None
    cfg.train.handle_signals = False
    cfg.train.device = "cpu"
    cfg.checkpoint.every = 2
    cfg.checkpoint.keep_last = 2
    cfg.checkpoint.async_save = async_save
    out = Path(tempfile.mkdtemp(dir=root))
    trainer = build_trainer(cfg, out_dir=out)
    saves: list[tuple[int, float, float]] = []
    trainer.callbacks.register(
        "on_checkpoint_save",
        lambda ctx: saves.append(
            (
                ctx.state.step,
                ctx.checkpoint_timing.blocked_seconds,
                ctx.checkpoint_timing.seconds,
            )
        ),
    )
    cpu: dict[int, float] = {}
    save = trainer.save_checkpoint

    def timed_save():  # the loop calls self.save_checkpoint(): this instance attribute
        began = time.thread_time()
        path = save()
        if path is not None:
            cpu[trainer.state.step] = time.thread_time() - began
        return path

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    began = time.perf_counter()
    trainer.train()
    took = time.perf_counter() - began
    return [(b, s, cpu[step]) for step, b, s in saves if step < steps], took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 6 steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mode order")
    args = parser.parse_args(argv)
    rounds, steps = (3, 6) if args.quick else (args.rounds, args.steps)
    if rounds < 1 or steps < 4:
        parser.error("--rounds must be >= 1 and --steps >= 4 (at least one save before the last)")
    rng = random.Random(args.seed)
    blocked: dict[str, list[float]] = {m: [] for m in MODES}
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    train_s: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    ratios = []
    later: list[float] = []  # async saves after a run's first (buffers reused)
    with tempfile.TemporaryDirectory(prefix="hookloop-bench-ckpt-") as tmp:
        for r in range(rounds):
            per_round: dict[str, list[float]] = {}
            for mode in shuffled(MODES, rng):
                saves, took = one_run(steps, mode == "async", Path(tmp))
                per_round[mode] = [b for b, _, _ in saves]
                blocked[mode] += per_round[mode]
                if mode == "async":
                    later += per_round[mode][1:]
                seconds[mode] += [s for _, s, _ in saves]
                cpu[mode] += [c for _, _, c in saves]
                train_s[mode].append(took)
            ratios.append(median(per_round["async"]) / median(per_round["sync"]))
            print(
                f"round {r + 1}/{rounds}: blocked per save sync "
                f"{median(per_round['sync']) * 1e3:.1f} ms, async "
                f"{median(per_round['async']) * 1e3:.2f} ms",
                file=sys.stderr,
            )

    def ms(values: list[float]) -> str:
        lo, hi = quartiles(values)
        return f"{median(values) * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f})"

    rows = [
        [
            mode,
            len(blocked[mode]),
            ms(blocked[mode]),
            ms(seconds[mode]),
            ms(cpu[mode]),
            f"{median(train_s[mode]):.2f}",
        ]
        for mode in MODES
    ]
    if later:
        rows.append(["async, 2nd+ save", len(later), ms(later), "", "", ""])
    print(environment(f"recipe gpt-stdlib, {steps} steps, checkpoint.every=2"))
    print(f"{rounds} rounds; medians (IQR) over every save but each run's last\n")
    print(
        format_table(
            ["mode", "saves", "blocked ms", "save ms (to commit)", "loop CPU ms", "train() s"],
            rows,
        )
    )
    lo, hi = quartiles(ratios)
    ratio = median(ratios)
    cpu_ratio = median(cpu["async"]) / median(cpu["sync"])
    print(
        f"\nasync blocked / sync save: {ratio:.3f} (IQR {lo:.3f}-{hi:.3f}) over {rounds} "
        f"rounds; target <= {TARGET:.2f}: {verdict(ratio, TARGET)}"
    )
    print(
        f"loop CPU in save_checkpoint, async / sync: {cpu_ratio:.3f}; "
        f"target <= {TARGET:.2f}: {verdict(cpu_ratio, TARGET)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
