"""What firing an event costs: ``CallbackManager.fire(event, ctx)`` in nanoseconds.

For 0, 1 and 10 registered callbacks it times ``fire`` of an event that has
handlers (each callback's trivial ``on_train_step_end``) and of one that has
none (``on_train_step_start``, which no callback overrides), beside two floors
measured in the same run: a plain Python loop over the pre-bound methods
(``for h in handlers: h(ctx)``) and a bare function call. The last line gives
fire's cost per handler over the plain loop's (1.0 would be the floor).

Each measurement is a batch of ``--batch`` calls (unrolled ten to a loop
iteration, as ``timeit`` does, so the loop itself costs ~1 ns a call); all
cases are interleaved in a fresh random order in each of ``--rounds`` rounds,
and the table shows medians over rounds. Per-handler costs are computed per
round, ``(fire with n handlers - fire with none) / n``, then the median taken.

    python bench/dispatch.py              # 25 rounds of 200k calls per case
    python bench/dispatch.py --quick      # 5 rounds of 50k, a smoke test
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (
    CLOCKS,
    Stamp,
    environment,
    format_table,
    median,
    now,
    quartiles,
    shuffled,
    verdict,
)
from hookloop import Callback, CallbackContext, CallbackManager

UNROLL = 10  # calls per loop iteration in the timed code
HANDLED = "on_train_step_end"  # the event every benchmark callback overrides
UNHANDLED = "on_train_step_start"  # an event none of them overrides
COUNTS = (0, 1, 10)

TARGET_UNHANDLED_NS = 150.0
TARGET_PER_HANDLER_NS = 100.0


class Noop(Callback):
    """A callback whose one handler does nothing, so only dispatch is measured."""

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        pass


def noop(ctx: CallbackContext) -> None:
    pass


def build_cases() -> dict[str, tuple[str, dict[str, object]]]:
    """Case name -> (one statement, the names it uses)."""
    ctx = CallbackContext()
    cases: dict[str, tuple[str, dict[str, object]]] = {
        "loop": ("pass", {}),
        "call": ("noop(ctx)", {"noop": noop, "ctx": ctx}),
        "method": ("m(ctx)", {"m": Noop().on_train_step_end, "ctx": ctx}),
    }
    for n in COUNTS:
        callbacks = [Noop() for _ in range(n)]
        manager = CallbackManager(callbacks)
        assert len(manager.index[HANDLED]) == n and not manager.index[UNHANDLED]
        handlers = tuple(cb.on_train_step_end for cb in callbacks)
        cases[f"plain{n}"] = ("for h in hs: h(ctx)", {"hs": handlers, "ctx": ctx})
        # ``fire`` is bound once, as a caller holding the manager would: this times the
        # dispatch itself, not the attribute look-up of ``manager.fire``.
        names = {"fire": manager.fire, "ctx": ctx}
        cases[f"fire{n}"] = (f"fire({HANDLED!r}, ctx)", names)
        cases[f"unhandled{n}"] = (f"fire({UNHANDLED!r}, ctx)", names)
    return cases


Results = dict[str, dict[str, list[float]]]  # clock -> case -> ns per call, one per round


def make_timer(stmt: str, names: dict[str, object], batch: int) -> Callable[[], Stamp]:
    """A function returning (wall, cpu) ns per call of ``stmt``, timed over ``batch`` calls."""
    timer = timeit.Timer("\n".join([stmt] * UNROLL), globals=names, timer=now)
    number = max(1, batch // UNROLL)
    calls = number * UNROLL

    def measure() -> Stamp:
        spent = timer.timeit(number)  # a Stamp; timeit pauses the gc while it times
        return Stamp(spent.wall / calls, spent.cpu / calls)  # type: ignore[union-attr, arg-type]

    return measure


def run(rounds: int, batch: int, seed: int = 0) -> Results:
    timers = {name: make_timer(stmt, names, batch) for name, (stmt, names) in build_cases().items()}
    for fn in timers.values():  # warm-up, untimed
        fn()
    results: Results = {clock: {name: [] for name in timers} for clock in CLOCKS}
    rng = random.Random(seed)
    for _ in range(rounds):
        for name in shuffled(list(timers), rng):
            spent = timers[name]()
            results["wall"][name].append(spent.wall)
            results["cpu"][name].append(spent.cpu)
    return results


def per_handler(values: dict[str, list[float]], prefix: str, n: int) -> list[float]:
    """Per-round ``(case with n handlers - case with 0) / n``."""
    with_n, with_none = values[f"{prefix}{n}"], values[f"{prefix}0"]
    return [(a - b) / n for a, b in zip(with_n, with_none, strict=True)]


def report(results: Results, rounds: int, batch: int) -> str:
    wall, cpu = results["wall"], results["cpu"]

    def med(values: dict[str, list[float]], name: str) -> str:
        return f"{median(values[name]):.1f}"

    def iqr(values: list[float]) -> str:
        lo, hi = quartiles(values)
        return f"{lo:.0f}-{hi:.0f}"

    def calls(name: str) -> str:
        """Machine-speed-free: the case over a bare function call of the same round (cpu)."""
        ratios = [a / b for a, b in zip(cpu[name], cpu["call"], strict=True)]
        return f"{median(ratios):.2f}"

    def row(label: str, name: str, each: str = "", target: str = "", ok: str = "") -> list[str]:
        return [
            label,
            med(wall, name),
            iqr(wall[name]),
            med(cpu, name),
            iqr(cpu[name]),
            calls(name),
            each,
            target,
            ok,
        ]

    def both(compute: Callable[[dict[str, list[float]]], float]) -> tuple[float, float]:
        return compute(wall), compute(cpu)

    rows = [
        row("timing-loop overhead (per call)", "loop"),
        row("bare function call  noop(ctx)", "call"),
        row("bound method call   m(ctx)", "method"),
    ]
    for n in COUNTS:
        label = f"plain loop,      {n:>2} handlers"
        if n == 0:
            rows.append(row(label, "plain0"))
            continue
        w, c = both(lambda v, n=n: median(per_handler(v, "plain", n)))
        rows.append(row(label, f"plain{n}", f"{w:.1f} / {c:.1f}"))
    for n in COUNTS:
        label = f"fire, handled,   {n:>2} handlers"
        if n == 0:
            rows.append(row(label, "fire0"))
            continue
        w, c = both(lambda v, n=n: median(per_handler(v, "fire", n)))
        rows.append(
            row(
                label,
                f"fire{n}",
                f"{w:.1f} / {c:.1f}",
                f"<= {TARGET_PER_HANDLER_NS:.0f}/handler",
                f"{verdict(w, TARGET_PER_HANDLER_NS)} / {verdict(c, TARGET_PER_HANDLER_NS)}",
            )
        )
    for n in COUNTS:
        label = f"fire, unhandled, {n:>2} callbacks" + (" elsewhere" if n else "")
        w, c = both(lambda v, n=n: median(v[f"unhandled{n}"]))
        rows.append(
            row(
                label,
                f"unhandled{n}",
                "",
                f"<= {TARGET_UNHANDLED_NS:.0f}",
                f"{verdict(w, TARGET_UNHANDLED_NS)} / {verdict(c, TARGET_UNHANDLED_NS)}",
            )
        )
    table = format_table(
        ["case", "wall ns", "IQR", "cpu ns", "IQR", "x call", "ns/handler", "target", "wall/cpu"],
        rows,
    )

    def gap(n: int) -> str:
        w, c = both(
            lambda v: median([f - p for f, p in zip(v[f"fire{n}"], v[f"plain{n}"], strict=True)])
        )
        return f"{w:.1f} / {c:.1f} ns"

    def ratio(n: int) -> str:
        """fire's cost per handler over a plain loop's, per round (cpu), then the median."""
        fire, plain = per_handler(cpu, "fire", n), per_handler(cpu, "plain", n)
        return f"{median([f / p for f, p in zip(fire, plain, strict=True)]):.2f}"

    lines = [
        f"hookloop event dispatch: {rounds} interleaved rounds x {batch:,} calls per case "
        "(medians over rounds; IQR = 25th-75th percentile)",
        environment(),
        "",
        table,
        "",
        "wall = perf_counter_ns, cpu = process_time_ns (no time waiting for a core); "
        "pairs are wall / cpu",
        "ns/handler = (n handlers - 0 handlers) / n within each round, then the median; "
        "x call = case / bare function call of the same round (cpu; machine-speed free)",
        f"fire() over the plain loop (call, dict look-up, try blocks): {gap(0)} with no "
        f"handlers, {gap(10)} with 10",
        f"per handler, fire over the plain loop of bound methods (cpu): {ratio(1)} with 1 "
        f"handler, {ratio(10)} with 10",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds (default 25)")
    parser.add_argument(
        "--batch", type=int, default=200_000, help="calls per case per round (default 200000)"
    )
    parser.add_argument("--quick", action="store_true", help="5 rounds of 50k calls")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round case order")
    args = parser.parse_args(argv)
    rounds, batch = (5, 50_000) if args.quick else (args.rounds, args.batch)
    if rounds < 1 or batch < UNROLL:
        parser.error(f"--rounds must be >= 1 and --batch >= {UNROLL}")
    results = run(rounds, batch, args.seed)
    print(report(results, rounds, batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
