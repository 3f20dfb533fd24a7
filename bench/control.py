"""What the control server costs a training job, idle and while a client polls it.

The mlp-regression recipe (CPU, one torch thread, no evaluation, no checkpoints,
logging every 20 steps) trains ``--steps`` steps in-process under three
contenders:

- ``off``: no control server;
- ``on``: a ControlServer, nobody asking it anything;
- ``poll``: a ControlServer while a separate client process requests
  ``GET /jobs/<id>/status`` ``--rate`` times a second (50 by default, over one
  keep-alive connection like the dashboard; ``--fresh-connections`` opens one per
  request like repeated ``hookloop ctl JOB status``).

The client is another process, as a real one is: inside the training process
it would compete for the GIL and overstate the cost. Only the steady state is
timed, from step ``--warmup`` to the last (the server's start, a few
milliseconds, is left out). Each round runs the contenders in a fresh random
order; ratios are taken within a round and the table shows medians over rounds.

Separate runs differ by more than the effect on a busy shared machine, so a
second measurement compares polling with no polling inside ONE run: the
server stays up while the client is paused (SIGSTOP) and resumed (SIGCONT) in
alternating ``--window``-second windows, in random order within each pair;
steps are counted per window (skipping 0.1 s after each switch) and the ratio
of each pair's step rates is taken; the median over pairs is reported.

The target: polling at 50 requests/s slows training by less than 5 %
(``poll/on`` >= 0.95, and the same for the windowed ratio).

    python bench/control.py               # 9 rounds of 2500 steps + 16 window pairs
    python bench/control.py --quick       # 3 rounds of 600 steps + 5 window pairs
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _timing import Stamp, environment, format_table, median, now, quartiles, shuffled, verdict
from hookloop import Callback
from hookloop.config import apply_overrides
from hookloop.control import ControlServer
from hookloop.entry import build_trainer
from hookloop.recipes import default_config

CONTENDERS = ("off", "on", "poll")
POLLED_JOB = "bench-polled"
LIMIT = 0.05  # the most slowdown polling may cause

# The polling client: stdlib only, so it starts in milliseconds. It waits for
# POLLED_JOB's endpoint, polls its status at RATE per second on absolute
# deadlines, follows the job to a new port when it comes back, and keeps the
# count of answered requests in COUNT_FILE.
POLLER = textwrap.dedent(
    """
    import http.client, json, os, sys, time
    jobs_dir, job_id, rate, fresh, count_file = sys.argv[1:6]
    rate, fresh = float(rate), fresh == "1"
    period, answered, conn, target, last_write = 1.0 / rate, 0, None, None, 0.0
    endpoint = os.path.join(jobs_dir, job_id, "endpoint.json")
    token_file = os.path.join(jobs_dir, job_id, "auth_token")
    deadline = time.monotonic()
    while True:
        deadline += period
        pause = deadline - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            deadline = time.monotonic()  # fell behind: do not burst to catch up
        try:
            if target is None:
                with open(endpoint) as f:
                    port = json.load(f)["port"]
                with open(token_file) as f:
                    token = f.read().strip()
                target = (port, {"Authorization": "Bearer " + token})
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", target[0], timeout=5)
            conn.request("GET", "/jobs/%s/status" % job_id, headers=target[1])
            response = conn.getresponse()
            response.read()
            answered += response.status == 200
            if fresh:
                conn.close()
                conn = None
        except (OSError, ValueError, KeyError, http.client.HTTPException):
            if conn is not None:
                conn.close()
            conn, target = None, None
        if time.monotonic() - last_write > 0.25:
            with open(count_file + ".tmp", "w") as f:
                f.write(str(answered))
            os.replace(count_file + ".tmp", count_file)
            last_write = time.monotonic()
    """
)


class _Clock(Callback):
    """Reads both clocks when step ``warmup`` ends and when the last step ends."""

    priority = 200

    def __init__(self, warmup: int, last: int) -> None:
        self.warmup, self.last = warmup, last
        self.start: Stamp | None = None
        self.end: Stamp | None = None

    def on_train_step_end(self, ctx: Any) -> None:
        step = ctx.state.step
        if step == self.warmup:
            self.start = now()
        elif step == self.last:
            self.end = now()


class _StepTimes(Callback):
    """The wall time at the end of every step (one list append: no measurable cost)."""

    priority = 200

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_step_end(self, ctx: Any) -> None:
        self.times.append(time.perf_counter())


def _config(steps: int) -> Any:
    cfg = default_config("mlp-regression")
    apply_overrides(
        cfg,
        [
            "train.device=cpu",
            f"train.max_steps={steps}",
            "train.eval_every=null",
            "train.eval_at_epoch_end=false",
            "train.log_every=20",
            "train.handle_signals=false",
            "logging.progress=false",
        ],
    )
    return cfg


def run_once(contender: str, steps: int, warmup: int, jobs_dir: Path) -> Stamp:
    """Both clocks' steady-state duration of one training run."""
    clock = _Clock(warmup, steps)
    callbacks: list[Callback] = [clock]
    if contender != "off":
        job_id = POLLED_JOB if contender == "poll" else "bench-idle"
        callbacks.append(ControlServer(job_id=job_id, jobs_dir=jobs_dir, announce=False))
    # (the server starts in on_train_start; the client, retrying every period, has
    # connected long before the warm-up steps are over)
    build_trainer(_config(steps), callbacks=callbacks).train()
    assert clock.start is not None and clock.end is not None
    return clock.end - clock.start


def _read_count(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--warmup", type=int, default=100, help="untimed steps at the start")
    parser.add_argument("--rate", type=float, default=50.0, help="status requests per second")
    parser.add_argument("--fresh-connections", action="store_true")
    parser.add_argument("--pairs", type=int, default=16, help="polling/paused window pairs")
    parser.add_argument("--window", type=float, default=1.0, help="window length in seconds")
    parser.add_argument(
        "--quick", action="store_true", help="3 rounds of 600 steps, 5 window pairs"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.pairs = 3, 600, 100, 5
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")
    torch.set_num_threads(1)
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory(prefix="hookloop-bench-control-") as tmp:
        jobs_dir = Path(tmp) / "jobs"
        count_file = Path(tmp) / "answered"
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        poller = subprocess.Popen(
            [sys.executable, "-c", POLLER, str(jobs_dir), POLLED_JOB, str(args.rate),
             "1" if args.fresh_connections else "0", str(count_file)],
            env=env,
        )  # fmt: skip
        try:
            results = _rounds(args, rng, jobs_dir, count_file)
            results["windows"] = _windows(args, rng, jobs_dir, count_file, poller)
        finally:
            os.kill(poller.pid, signal.SIGCONT)
            poller.terminate()
            poller.wait(timeout=10)
    _report(args, results)
    return 0


def _rounds(
    args: argparse.Namespace, rng: random.Random, jobs_dir: Path, count_file: Path
) -> dict[str, Any]:
    rates: dict[str, dict[str, list[float]]] = {c: {"wall": [], "cpu": []} for c in CONTENDERS}
    ratios: dict[str, list[float]] = {"on/off": [], "poll/on": [], "poll/off": []}
    cpu_ratios: dict[str, list[float]] = {"on/off": [], "poll/on": [], "poll/off": []}
    achieved: list[float] = []
    timed = args.steps - args.warmup
    run_once("off", args.warmup + 20, args.warmup, jobs_dir)  # warm caches and allocator
    for r in range(args.rounds):
        row: dict[str, Stamp] = {}
        for contender in shuffled(CONTENDERS, rng):
            before, started = _read_count(count_file), time.monotonic()
            row[contender] = run_once(contender, args.steps, args.warmup, jobs_dir)
            if contender == "poll":  # requests answered while the server was up
                served = time.monotonic() - started
                time.sleep(0.3)  # the client writes its count every 0.25 s
                achieved.append((_read_count(count_file) - before) / served)
        for c in CONTENDERS:
            rates[c]["wall"].append(timed / (row[c].wall / 1e9))
            rates[c]["cpu"].append(timed / (row[c].cpu / 1e9))
        for name in ratios:
            a, b = name.split("/")
            ratios[name].append(row[b].wall / row[a].wall)  # steps/s of a over steps/s of b
            cpu_ratios[name].append(row[b].cpu / row[a].cpu)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{c} {rates[c]['wall'][-1]:.1f} steps/s" for c in CONTENDERS)
            + (f", client {achieved[-1]:.1f} req/s" if achieved else ""),
            file=sys.stderr,
        )
    return {"rates": rates, "ratios": ratios, "cpu_ratios": cpu_ratios, "achieved": achieved}


def _windows(
    args: argparse.Namespace,
    rng: random.Random,
    jobs_dir: Path,
    count_file: Path,
    poller: subprocess.Popen[bytes],
) -> dict[str, Any]:
    """One run with the server up; the client polls in every other window."""
    clock = _StepTimes()
    trainer = build_trainer(
        _config(10**9),
        callbacks=[clock, ControlServer(job_id=POLLED_JOB, jobs_dir=jobs_dir, announce=False)],
    )
    marks: list[tuple[float, bool]] = []
    polled = {"requests": 0, "seconds": 0.0}

    def switch() -> None:
        try:
            while len(clock.times) < args.warmup:
                time.sleep(0.01)
            time.sleep(0.5)  # the client reconnects to this run's server
            for _ in range(args.pairs):
                for polling in shuffled([True, False], rng):
                    os.kill(poller.pid, signal.SIGCONT if polling else signal.SIGSTOP)
                    marks.append((time.perf_counter(), polling))
                    before = _read_count(count_file)
                    time.sleep(args.window)
                    if polling:
                        polled["seconds"] += args.window
                        time.sleep(0.3)  # let the client write its count
                        polled["requests"] += _read_count(count_file) - before
                        polled["seconds"] += 0.3
            marks.append((time.perf_counter(), False))
        finally:
            os.kill(poller.pid, signal.SIGCONT)
            trainer.control.request_stop("bench over")

    switcher = threading.Thread(target=switch, daemon=True)
    switcher.start()
    trainer.train()
    switcher.join()
    settle = 0.1
    rate: dict[bool, list[float]] = {True: [], False: []}
    for (start, polling), (end, _) in itertools.pairwise(marks):
        if polling:  # the polling window also ran through the count pause
            end = start + args.window
        lo = bisect.bisect_left(clock.times, start + settle)
        hi = bisect.bisect_left(clock.times, end)
        rate[polling].append((hi - lo) / (end - start - settle))
    ratios = [p / q for p, q in zip(rate[True], rate[False], strict=True)]
    print(
        f"windows: {len(ratios)} pairs, polling/paused median {median(ratios):.3f}",
        file=sys.stderr,
    )
    return {
        "ratios": ratios,
        "polling": median(rate[True]),
        "paused": median(rate[False]),
        "achieved": polled["requests"] / max(polled["seconds"], 1e-9),
    }


def _report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    rates, ratios, cpu_ratios = results["rates"], results["ratios"], results["cpu_ratios"]
    print()
    print(
        f"control server overhead: mlp-regression, {args.rounds} rounds x "
        f"{args.steps - args.warmup} timed steps, client at {args.rate:g} req/s "
        f"({'a new connection per request' if args.fresh_connections else 'keep-alive'}; "
        f"achieved median {median(results['achieved']):.1f} req/s)"
    )
    print(environment())
    print()
    rows = []
    for c in CONTENDERS:
        lo, hi = quartiles(rates[c]["wall"])
        rows.append([c, f"{median(rates[c]['wall']):.1f}", f"{lo:.1f}-{hi:.1f}",
                     f"{median(rates[c]['cpu']):.1f}"])  # fmt: skip
    print(format_table(["contender", "steps/s (wall)", "IQR", "steps/s (cpu)"], rows))
    print()
    rows = []
    for name in ratios:
        wall, cpu = median(ratios[name]), median(cpu_ratios[name])
        target = verdict(1 - wall, LIMIT) if name != "on/off" else ""
        rows.append([name, f"{wall:.3f}", f"{(1 - wall) * 100:+.1f} %", f"{cpu:.3f}", target])
    print(format_table(["ratio (median)", "wall", "slowdown", "cpu", f"< {LIMIT:.0%}"], rows))
    win = results["windows"]
    lo, hi = quartiles(win["ratios"])
    print()
    print(
        f"one run, client paused/resumed in {len(win['ratios'])} random-order pairs of "
        f"{args.window:g} s windows (client ~{win['achieved']:.1f} req/s while polling):"
    )
    print(
        format_table(
            ["window", "steps/s (median)", "ratio polling/paused", "IQR", "slowdown", "< 5%"],
            [
                ["paused", f"{win['paused']:.1f}"],
                [
                    "polling",
                    f"{win['polling']:.1f}",
                    f"{median(win['ratios']):.3f}",
                    f"{lo:.3f}-{hi:.3f}",
                    f"{(1 - median(win['ratios'])) * 100:+.1f} %",
                    verdict(1 - median(win["ratios"]), LIMIT),
                ],
            ],
        )
    )
    summary = {
        "rates": {c: median(rates[c]["wall"]) for c in CONTENDERS},
        "ratios": {k: median(v) for k, v in ratios.items()},
        "achieved_req_per_s": median(results["achieved"]),
        "window_ratio": median(win["ratios"]),
    }
    print()
    print("json:", json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
