"""Step-time jitter with the interpreter's garbage collector against ``train.gc_every``.

The problem is ``loop.py``'s (Linear(32, 64) -> ReLU -> Linear(64, 1), batch 32, MSE,
SGD, one CPU thread) plus what makes collection expensive in real jobs: a large heap
of long-lived Python objects built at set-up (``--heap`` small lists, standing in for
a tokenizer's vocabulary or a dataset index); objects that live a while and then
die (each step puts ``--keep`` small lists into a window of the last ``--window``
steps, as prefetch queues and metric windows do); and a little cyclic garbage
(``--cycles`` self-referencing lists a step, which only the collector frees). The
garbage makes the collector run; the objects that outlive two collections count as
long-lived, and once they reach a quarter of the heap the next collection is a full
one, which walks the whole heap, on whatever step that happens to be.

Contenders, interleaved in a fresh random order each round:

- ``raw``: a hand-written loop under the interpreter's automatic collector (reference);
- ``hookloop-auto``: ``Trainer.train()`` with ``train.gc_every`` unset (automatic GC);
- ``hookloop-gc<N>``: the same with ``train.gc_every=N``: automatic GC off, the set-up
  heap frozen, ``gc.collect()`` every N steps.

Every step's duration is recorded on both clocks (the hookloop contenders stamp
``on_train_step_start``, so a step includes its boundary and any collection after
it). The table pools the steps of all rounds: p50, p99 and max step time, the
full (generation-2) collections counted through ``gc.callbacks``, and the median
over rounds of the whole run's time as a ratio to the raw run of the same round.

    python bench/gc_jitter.py          # 8 rounds of 3000 steps, heap of 500k objects
    python bench/gc_jitter.py --quick  # 3 rounds of 1500 steps
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

from _timing import CLOCKS, environment, format_table, median, shuffled
from hookloop import Callback, CallbackManager, TrainConfig, Trainer


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def one_step(window: deque, keep: int, cycles: int, step: int) -> None:
    """The Python objects every loop makes in a step, besides its tensors."""
    window.append([[step] for _ in range(keep)])
    for _ in range(cycles):
        garbage: list = [step]
        garbage.append(garbage)


class Stamps(Callback):
    """Both clocks at each step's start, plus the per-step record every loop keeps."""

    def __init__(self, wall: list[int], cpu: list[int], window: deque, keep: int, cycles: int):
        self.wall, self.cpu, self.window, self.keep, self.cycles = wall, cpu, window, keep, cycles

    def on_train_step_start(self, ctx) -> None:
        self.wall.append(time.perf_counter_ns())
        self.cpu.append(time.process_time_ns())
        one_step(self.window, self.keep, self.cycles, ctx.state.step)


def run_once(
    name: str, data, heap_size: int, every: int, keep: int, window_steps: int, cycles: int
) -> dict[str, object]:
    """One contender's run: per-step wall/cpu ns, full collections, total wall/cpu ns."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mse = nn.MSELoss()
    heap = [[i, i] for i in range(heap_size)]  # long-lived set-up objects (GC-tracked)
    wall: list[int] = []
    cpu: list[int] = []
    window: deque = deque(maxlen=window_steps)
    fulls = [0]

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            fulls[0] += 1

    run: Callable[[], object]
    if name == "raw":

        def run() -> None:
            for i, (x, y) in enumerate(data):
                wall.append(time.perf_counter_ns())
                cpu.append(time.process_time_ns())
                one_step(window, keep, cycles, i + 1)
                loss = mse(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    else:
        config = TrainConfig(
            max_steps=len(data),
            log_every=0,
            clip_grad_norm=None,
            skip_nonfinite=False,
            handle_signals=False,
            device="cpu",
            gc_every=None if name == "hookloop-auto" else every,
        )
        trainer = Trainer(
            model,
            opt,
            train_data=data,
            loss_fn=mse,
            config=config,
            callbacks=CallbackManager([Stamps(wall, cpu, window, keep, cycles)]),
        )
        run = trainer.train
    gc.collect()
    gc.callbacks.append(count)
    start_wall, start_cpu = time.perf_counter_ns(), time.process_time_ns()
    try:
        run()
    finally:
        gc.callbacks.remove(count)
    end_wall, end_cpu = time.perf_counter_ns(), time.process_time_ns()
    wall.append(end_wall)
    cpu.append(end_cpu)
    del heap
    window.clear()
    return {
        "wall": [b - a for a, b in itertools.pairwise(wall)],
        "cpu": [b - a for a, b in itertools.pairwise(cpu)],
        "fulls": fulls[0],
        "total_wall": end_wall - start_wall,
        "total_cpu": end_cpu - start_cpu,
    }


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--heap", type=int, default=500_000, help="long-lived set-up objects")
    parser.add_argument("--keep", type=int, default=200, help="objects each step keeps a while")
    parser.add_argument("--window", type=int, default=100, help="steps they are kept")
    parser.add_argument("--cycles", type=int, default=100, help="cyclic garbage a step")
    parser.add_argument("--every", type=int, default=200, help="train.gc_every for hookloop-gcN")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1500 steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 1500
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(32, 32, generator=gen), torch.randn(32, 1, generator=gen))
        for _ in range(args.steps)
    ]
    names = ["raw", "hookloop-auto", f"hookloop-gc{args.every}"]
    rng = random.Random(args.seed)
    steps: dict[str, dict[str, list[int]]] = {n: {c: [] for c in CLOCKS} for n in names}
    fulls: dict[str, list[int]] = {n: [] for n in names}
    ratios: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CLOCKS} for n in names}
    for name in names:  # warm-up, untimed
        run_once(name, data[:100], args.heap, args.every, args.keep, args.window, args.cycles)
    for _ in range(args.rounds):
        results = {
            n: run_once(n, data, args.heap, args.every, args.keep, args.window, args.cycles)
            for n in shuffled(names, rng)
        }
        for name, res in results.items():
            for clock in CLOCKS:
                steps[name][clock] += res[clock]  # type: ignore[operator]
                raw_total = results["raw"][f"total_{clock}"]
                ratios[name][clock].append(res[f"total_{clock}"] / raw_total)  # type: ignore[operator]
            fulls[name].append(res["fulls"])  # type: ignore[arg-type]

    rows = []
    for name in names:
        row = [name]
        for clock in CLOCKS:
            values = steps[name][clock]
            row += [
                f"{percentile(values, 0.5) / 1e3:.0f}",
                f"{percentile(values, 0.99) / 1e3:.0f}",
                f"{max(values) / 1e3:.0f}",
                f"{statistics.pstdev(values) / 1e3:.0f}",
            ]
        row += [f"{median(fulls[name]):.0f}", f"{median(ratios[name]['wall']):.3f}"]
        row.append(f"{median(ratios[name]['cpu']):.3f}")
        rows.append(row)
    headers = ["contender"]
    for clock in CLOCKS:
        headers += [f"{clock} p50 us", "p99 us", "max us", "sd us"]
    headers += ["full GCs/run", "wall x raw", "cpu x raw"]
    print(
        f"step-time jitter, automatic GC vs train.gc_every={args.every}: {args.rounds} rounds x "
        f"{args.steps} steps, heap of {args.heap:,} long-lived objects, {args.keep} kept "
        f"{args.window} steps and {args.cycles} cyclic garbage by each step (steps pooled "
        "over rounds; ratios: medians over rounds against the same round's raw run)"
    )
    print(environment())
    print()
    print(format_table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
