"""Trainer step time against a hand-written PyTorch loop on the same tiny problem.

A Linear(32, 64) -> ReLU -> Linear(64, 1) MLP, batch 32, MSE loss, SGD lr 0.01,
one CPU thread, ``--steps`` steps over a pre-generated list of (x, y) tensor
pairs (no DataLoader on either side), every run starting from the same weights.
Contenders:

- ``raw``: ``out = model(x); loss = mse(out, y); loss.backward(); opt.step();
  opt.zero_grad(set_to_none=True)`` for each pair;
- ``hookloop-bare``: ``Trainer.train()`` with no callbacks, no logging, no
  clipping and no finiteness check: the raw loop's semantics;
- ``hookloop-default``: the callbacks ``hookloop train`` adds by default (see
  ``default_callbacks`` below), ``log_every=10``, ``skip_nonfinite=True``;
- ``hookloop-clip``: bare plus ``clip_grad_norm=1.0`` and ``skip_nonfinite=True``
  (for information; no target);
- ``raw-lean``: the raw loop calling the optimizer as hookloop's step does:
  ``opt.step()``, then ``p.grad = None`` for each parameter in place of
  ``opt.zero_grad(set_to_none=True)`` (the same effect, without the profiler range
  torch opens around every ``zero_grad`` call); hookloop's own cost is its excess over
  this one. For information, no target.

Only ``.train()`` (or the raw loop) is timed; model, optimizer and Trainer are
built before the clock starts. In each round the contenders run in a fresh
random order, each between two raw runs, and its ratio is taken against the
mean of those two neighbours; the table shows medians over rounds.

    python bench/loop.py                  # 25 rounds of 2000 steps
    python bench/loop.py --quick          # 5 rounds of 500 steps
    python bench/loop.py --profile        # also: where a hookloop-default step spends time
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import inspect
import io
import os
import pstats
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import hookloop.callbacks
from _timing import (
    CLOCKS,
    Stamp,
    environment,
    format_table,
    median,
    quartiles,
    shuffled,
    time_ns,
    verdict,
)
from hookloop import Callback, Config, TrainConfig, Trainer
from hookloop.callbacks import InfoCallback, JsonLogger, ModelSummary, ProgressBar

TARGETS = {"hookloop-bare": 1.03, "hookloop-default": 1.10}
CONTENDERS = ("hookloop-bare", "hookloop-default", "hookloop-clip", "raw-lean")


# -- the default callback set (extend it here) -----------------------------------------------


def default_callbacks(run_dir: Path, sink: TextIO) -> tuple[list[Callback], str]:
    """The callbacks ``hookloop train`` adds by default, checkpointing and control server off.

    Uses ``hookloop.callbacks.default_callbacks`` when hookloop has one, else the list
    below (what ``hookloop train`` builds today). Progress output goes to ``sink`` as plain
    lines (no tqdm), JSON logs into ``run_dir``. Returns the callbacks and where they came from.
    """
    factory = getattr(hookloop.callbacks, "default_callbacks", None)
    if factory is None:
        callbacks: list[Callback] = [
            ProgressBar(stream=sink, use_tqdm=False),
            JsonLogger(run_dir / "metrics.jsonl"),
        ]
        return callbacks, "bench/loop.py's own list; hookloop has no callbacks.default_callbacks"
    callbacks = list(_call_factory(factory, run_dir))
    for cb in callbacks:
        if isinstance(cb, ProgressBar):  # keep the terminal quiet and the mode non-TTY
            cb.stream, cb.use_tqdm = sink, False
        elif isinstance(cb, (InfoCallback, ModelSummary)):  # their summaries, too
            cb.stream = sink
    return callbacks, "hookloop.callbacks.default_callbacks()"


def _call_factory(factory: Callable[..., Any], run_dir: Path) -> list[Callback]:
    """Call ``default_callbacks`` with whichever of these arguments it declares."""
    cfg = Config(train=default_config(1))  # checkpoint.every is None: no periodic saves
    offered = {
        "config": cfg,
        "cfg": cfg,
        "run_dir": run_dir,
        "out_dir": run_dir,
        "log_dir": run_dir,
        "path": run_dir,
        "checkpoint": False,
        "checkpoints": False,
        "control": False,
        "control_server": False,
    }
    kwargs = {}
    for name, param in inspect.signature(factory).parameters.items():
        if name in offered:
            kwargs[name] = offered[name]
        elif param.default is param.empty and param.kind not in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        ):
            raise SystemExit(
                f"bench/loop.py: hookloop.callbacks.default_callbacks needs {name!r}, which "
                "this benchmark does not know how to give; teach _call_factory about it"
            )
    return list(factory(**kwargs))


# -- configurations -----------------------------------------------------------------------------


def bare_config(steps: int) -> TrainConfig:
    return TrainConfig(
        max_steps=steps,
        log_every=0,
        clip_grad_norm=None,
        skip_nonfinite=False,
        handle_signals=False,
        device="cpu",
    )


def default_config(steps: int) -> TrainConfig:
    # skip_nonfinite is left at its default (True); signal handlers are installed once per
    # train() and cost nothing per step, so they stay off to keep Ctrl-C plain here.
    return TrainConfig(
        max_steps=steps, log_every=10, clip_grad_norm=None, handle_signals=False, device="cpu"
    )


def clip_config(steps: int) -> TrainConfig:
    return TrainConfig(
        max_steps=steps,
        log_every=0,
        clip_grad_norm=1.0,
        skip_nonfinite=True,
        handle_signals=False,
        device="cpu",
    )


# -- the problem ----------------------------------------------------------------------------------


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


@dataclass
class Problem:
    data: list[tuple[torch.Tensor, torch.Tensor]]
    init_state: dict[str, torch.Tensor]
    run_dir: Path
    sink: TextIO
    runs: int = 0

    @classmethod
    def make(cls, steps: int, run_dir: Path, sink: TextIO) -> Problem:
        gen = torch.Generator().manual_seed(0)
        data = [
            (torch.randn(32, 32, generator=gen), torch.randn(32, 1, generator=gen))
            for _ in range(steps)
        ]
        torch.manual_seed(0)
        init_state = copy.deepcopy(make_model().state_dict())
        return cls(data, init_state, run_dir, sink)

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_model()
        model.load_state_dict(self.init_state)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)


@dataclass
class Prepared:
    run: Callable[[], Any]  # the timed part
    model: nn.Module
    close: Callable[[], None] = lambda: None


def prepare(name: str, problem: Problem, changes: dict[str, Any] | None = None) -> Prepared:
    """Build a contender's model, optimizer (and Trainer) outside the timed region;
    ``changes``: TrainConfig fields set differently (the attribution's variants)."""
    model, opt = problem.fresh()
    mse = nn.MSELoss()
    steps = len(problem.data)
    if name == "raw":
        data = problem.data

        def raw_loop() -> None:
            for x, y in data:
                out = model(x)
                loss = mse(out, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        return Prepared(raw_loop, model)
    if name == "raw-lean":
        data, params = problem.data, list(model.parameters())

        def raw_lean_loop() -> None:
            for x, y in data:
                out = model(x)
                loss = mse(out, y)
                loss.backward()
                opt.step()
                for p in params:
                    p.grad = None

        return Prepared(raw_lean_loop, model)
    callbacks: list[Callback] = []
    if name == "hookloop-bare":
        config = bare_config(steps)
    elif name == "hookloop-default":
        config = default_config(steps)
        problem.runs += 1
        run_dir = problem.run_dir / f"run{problem.runs}"
        callbacks, _ = default_callbacks(run_dir, problem.sink)
    elif name == "hookloop-clip":
        config = clip_config(steps)
    else:
        raise ValueError(f"unknown contender {name!r}")
    for key, value in (changes or {}).items():
        setattr(config, key, value)
    trainer = Trainer(
        model, opt, train_data=problem.data, loss_fn=mse, config=config, callbacks=callbacks
    )

    def close() -> None:
        for cb in callbacks:
            if hasattr(cb, "close"):
                cb.close()

    return Prepared(trainer.train, model, close)


def timed(name: str, problem: Problem) -> tuple[Stamp, nn.Module]:
    """Wall and CPU ns of one run of ``name`` (the gc is collected first, left on inside)."""
    prepared = prepare(name, problem)
    gc.collect()
    try:
        spent = time_ns(prepared.run)
    finally:
        prepared.close()
    return spent, prepared.model


# -- the benchmark --------------------------------------------------------------------------------


@dataclass
class Results:
    raw: list[Stamp]
    spent: dict[str, list[Stamp]]
    ratios: dict[str, dict[str, list[float]]]  # clock -> contender -> one ratio per round

    def ns(self, clock: str, name: str) -> list[int]:
        return [getattr(s, clock) for s in (self.raw if name == "raw" else self.spent[name])]


def run_rounds(problem: Problem, rounds: int, seed: int = 0) -> Results:
    rng = random.Random(seed)
    res = Results([], {c: [] for c in CONTENDERS}, {k: {c: [] for c in CONTENDERS} for k in CLOCKS})
    for _ in range(rounds):
        before, _ = timed("raw", problem)
        res.raw.append(before)
        for name in shuffled(CONTENDERS, rng):
            spent, _ = timed(name, problem)
            after, _ = timed("raw", problem)
            res.raw.append(after)
            res.spent[name].append(spent)
            for clock in CLOCKS:
                neighbours = (getattr(before, clock) + getattr(after, clock)) / 2
                res.ratios[clock][name].append(getattr(spent, clock) / neighbours)
            before = after
    return res


def check_same_result(problem: Problem) -> str:
    """Do the contenders that share raw's semantics end at raw's weights? (Also a warm-up.)"""
    finals = {}
    for name in ("raw", *CONTENDERS):
        _, model = timed(name, problem)
        finals[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    parts = []
    for name in ("hookloop-bare", "hookloop-default", "raw-lean"):
        diff = (finals[name] - finals["raw"]).abs().max().item()
        parts.append(f"{name} {'identical' if diff == 0 else f'max |diff| {diff:.1e}'}")
    return "final weights vs raw: " + ", ".join(parts)


def report(res: Results, rounds: int, steps: int, source: str, names: str, check: str) -> str:
    def us(clock: str, name: str) -> float:
        return median(res.ns(clock, name)) / steps / 1000

    def iqr(values: list[float]) -> str:
        lo, hi = quartiles(values)
        return f"{lo:.3f}-{hi:.3f}"

    rows = [["raw", f"{us('wall', 'raw'):.1f}", "1.000", "", f"{us('cpu', 'raw'):.1f}", "1.000"]]
    raw_cpu_us = us("cpu", "raw")
    for name in CONTENDERS:
        wall, cpu = res.ratios["wall"][name], res.ratios["cpu"][name]
        target = TARGETS.get(name)
        rows.append(
            [
                name,
                f"{us('wall', name):.1f}",
                f"{median(wall):.3f}",
                iqr(wall),
                f"{us('cpu', name):.1f}",
                f"{median(cpu):.3f}",
                iqr(cpu),
                f"{(median(cpu) - 1) * raw_cpu_us:+.1f}",
                f"<= {target:.2f}x" if target else "(info)",
                f"{verdict(median(wall), target)} / {verdict(median(cpu), target)}"
                if target
                else "",
            ]
        )
    headers = ["contender", "wall us/step", "x raw", "IQR", "cpu us/step", "x raw", "IQR"]
    table = format_table([*headers, "+cpu us/step", "target", "wall/cpu"], rows)
    return "\n".join(
        [
            f"hookloop Trainer vs raw PyTorch loop: {rounds} interleaved rounds x {steps} steps "
            "(medians over rounds; each contender timed between two raw runs)",
            environment(),
            f"default callbacks: {names} [{source}]",
            "",
            table,
            "",
            "x raw: contender / mean of its two neighbouring raw runs, per round, then the median; "
            "IQR: 25th-75th percentile of it",
            "wall = perf_counter_ns; cpu = process_time_ns, which leaves out time spent waiting "
            "for a core (steadier on a shared machine)",
            "+cpu us/step = (cpu x raw - 1) * raw cpu us/step",
            check,
        ]
    )


def profile_default(problem: Problem, top: int = 18) -> str:
    """cProfile one hookloop-default run: the functions with the most own time, per step."""
    prepared = prepare("hookloop-default", problem)
    profiler = cProfile.Profile()
    try:
        profiler.runcall(prepared.run)
    finally:
        prepared.close()
    steps = len(problem.data)
    stats = pstats.Stats(profiler)
    rows = []
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in entries[:top]:
        where = f"{Path(filename).name}:{line}" if line else filename
        rows.append(
            [
                f"{func} ({where})"[:70],
                f"{ncalls / steps:.1f}",
                f"{tottime / steps * 1e6:.1f}",
                f"{cumtime / steps * 1e6:.1f}",
            ]
        )
    table = format_table(
        ["function (hookloop-default, cProfile)", "calls/step", "own us/step", "cum us/step"], rows
    )
    return "\n".join(
        ["", table, "(cProfile inflates small Python functions; read it for where, not how much)"]
    )


def callback_cost(problem: Problem) -> str:
    """hookloop's own cost report (``CallbackManager.profile()``) for one hookloop-default run."""
    prepared = prepare("hookloop-default", problem)
    trainer = prepared.run.__self__  # the bound Trainer.train
    profile = trainer.callbacks.profile()
    try:
        prepared.run()
    finally:
        trainer.callbacks.profile(False)
        prepared.close()
    steps = len(problem.data)
    return "\n".join(
        ["", f"hookloop-default, {steps} steps, CallbackManager.profile():", profile.table()]
    )


# -- attribution: where the overhead goes ------------------------------------------------------


class ShellOnly(Trainer):
    """A probe, not an API: the Trainer's loop (budget, data fetch, step boundary) around a
    step that is raw-lean's body plus the step counters, so its excess over raw-lean is
    what the loop costs outside the step."""

    def _train_step(self, group: list[Any]) -> None:
        st = self.progress
        st.step += 1
        st.epoch_step += 1
        inputs, targets = group[0]
        loss = self.probe_loss(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()  # the optimizer called as the Trainer's step calls it
        for p in self.probe_params:
            p.grad = None
        self.probe_last = loss  # held to the next step, as raw's `loss` variable is


#: Variant -> (contender it starts from, TrainConfig changes); None: the ShellOnly probe.
ATTRIBUTION: dict[str, tuple[str, dict[str, Any]] | None] = {
    "loop shell only (raw-lean step body inside the loop)": None,
    "no callbacks (hookloop-bare)": ("hookloop-bare", {}),
    "no callbacks, train.timers=off": ("hookloop-bare", {"timers": "off"}),
    "no callbacks + skip_nonfinite": ("hookloop-bare", {"skip_nonfinite": True}),
    "no callbacks + log every 10": ("hookloop-bare", {"log_every": 10}),
    "default callbacks, log every 1000": ("hookloop-default", {"log_every": 1000}),
    "default callbacks, no skip_nonfinite": ("hookloop-default", {"skip_nonfinite": False}),
    "default callbacks (hookloop-default)": ("hookloop-default", {}),
}


def prepare_variant(variant: str, problem: Problem) -> Prepared:
    spec = ATTRIBUTION[variant]
    if spec is None:
        model, opt = problem.fresh()
        trainer = ShellOnly(
            model, opt, train_data=problem.data, config=bare_config(len(problem.data))
        )
        trainer.probe_loss = nn.MSELoss()  # type: ignore[attr-defined]
        trainer.probe_params = list(model.parameters())  # type: ignore[attr-defined]
        return Prepared(trainer.train, model)
    name, changes = spec
    return prepare(name, problem, changes)


def attribute(problem: Problem, rounds: int, seed: int = 0) -> str:
    """Each variant's CPU excess over raw-lean (the raw loop calling the optimizer as the
    Trainer does), in interleaved rounds (each run between two raw-lean runs, as the main
    table does with raw): which part of hookloop's own cost is what."""
    rng = random.Random(seed)
    excess: dict[str, list[float]] = {v: [] for v in ATTRIBUTION}
    steps = len(problem.data)
    raw_us: list[float] = []

    def cpu_us(prepared: Prepared) -> float:
        gc.collect()
        try:
            return time_ns(prepared.run).cpu / steps / 1000
        finally:
            prepared.close()

    before = cpu_us(prepare("raw-lean", problem))
    for _ in range(rounds):
        for variant in shuffled(list(ATTRIBUTION), rng):
            spent = cpu_us(prepare_variant(variant, problem))
            after = cpu_us(prepare("raw-lean", problem))
            raw_us.append((before + after) / 2)
            excess[variant].append(spent - raw_us[-1])
            before = after
    raw = median(raw_us)
    rows = []
    for variant, values in excess.items():
        lo, hi = quartiles(values)
        rows.append([variant, f"{median(values):+.1f}", f"{lo:+.1f} .. {hi:+.1f}",
                     f"{1 + median(values) / raw:.3f}"])  # fmt: skip
    table = format_table(["variant", "+cpu us/step", "IQR", "x raw-lean"], rows)
    return "\n".join(
        [
            "",
            f"Attribution: {rounds} interleaved rounds x {steps} steps, raw-lean {raw:.1f} us/step "
            "(CPU; medians of each run's excess over its two raw-lean neighbours)",
            table,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds (default 25)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per run (default 2000)")
    parser.add_argument("--quick", action="store_true", help="5 rounds of 500 steps")
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile one hookloop-default run"
    )
    parser.add_argument(
        "--callback-cost",
        action="store_true",
        help="also run hookloop-default once under CallbackManager.profile() and print its table",
    )
    parser.add_argument(
        "--attribute",
        action="store_true",
        help="also measure variants (timers off, no finiteness check, fewer logs, the loop "
        "shell alone) to show which part costs what",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the contender order")
    args = parser.parse_args(argv)
    rounds, steps = (5, 500) if args.quick else (args.rounds, args.steps)
    if rounds < 1 or steps < 10:
        parser.error("--rounds must be >= 1 and --steps >= 10")
    torch.set_num_threads(1)
    with (
        tempfile.TemporaryDirectory(prefix="hookloop-bench-") as tmp,
        open(os.devnull, "w") as sink,
    ):
        problem = Problem.make(steps, Path(tmp), sink)
        cbs, source = default_callbacks(Path(tmp) / "probe", io.StringIO())
        names = " + ".join(type(cb).__name__ for cb in cbs) or "(none)"
        check = check_same_result(problem)
        results = run_rounds(problem, rounds, args.seed)
        print(report(results, rounds, steps, source, names, check))
        if args.profile:
            print(profile_default(problem))
        if args.callback_cost:
            print(callback_cost(problem))
        if args.attribute:
            print(attribute(problem, max(rounds // 2, 3), args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
