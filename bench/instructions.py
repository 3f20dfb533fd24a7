"""CPU instructions per training step, hookloop against the raw loop: bench/loop.py's
problem and contenders, counted by valgrind's callgrind instead of timed.

Time on a shared two-core machine drifts by tens of percent between identical runs;
an instruction count hardly does (the same contender counted twice in one run
differed by at most 0.4 %). So this is the bench to decide whether a change to the
step path helps, and by how much. bench/loop.py stays the one that says how fast
hookloop runs, since instructions are not time: the interpreter's instructions and
torch's kernels do not run at the same rate.

Each contender runs in a child python under callgrind, which counts only inside
``operator.call(train)`` (the set-up, the imports and a warm-up run are left out), once
for ``--steps`` steps and once for ``--base`` steps. The difference over the
difference in steps is the count per step: what a run costs once (``train()``'s
set-up, the final drain) cancels. Children run in parallel, one per core.

    python bench/instructions.py                 # raw, hookloop-bare, hookloop-default,
                                                 # raw-lean
    python bench/instructions.py --attribute     # also bench/loop.py's attribution variants

Needs valgrind (``apt-get install valgrind``). Under callgrind a torch import takes about two
minutes, so the default set takes about 10 minutes on two cores, --attribute about 40.
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _timing import environment, format_table  # noqa: E402

CONTENDERS = ("raw", "hookloop-bare", "hookloop-default", "raw-lean")


def child(name: str, steps: int, changes: dict | None) -> None:
    """Build ``name``, warm it up on a short problem, then train under ``operator.call``
    (the only place callgrind counts)."""
    import torch

    import loop

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as sink:

        def build(problem: loop.Problem) -> loop.Prepared:
            if name in loop.ATTRIBUTION:
                return loop.prepare_variant(name, problem)
            return loop.prepare(name, problem, changes)

        warm = build(loop.Problem.make(30, Path(tmp) / "warm", sink))
        warm.run()
        warm.close()
        prepared = build(loop.Problem.make(steps, Path(tmp) / "run", sink))
        gc.collect()
        operator.call(prepared.run)
        prepared.close()


def count(name: str, steps: int, changes: dict | None, out_dir: Path) -> int:
    """Instructions callgrind counted inside the training run of ``steps`` steps."""
    tag = f"{abs(hash((name, json.dumps(changes))))}-{steps}"
    out = out_dir / f"callgrind.{tag}"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=_operator_call",
        f"--callgrind-out-file={out}",
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        json.dumps([name, steps, changes]),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"bench/instructions.py: {name} failed:\n{done.stderr[-3000:]}")
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"bench/instructions.py: no instruction total in {out}")


def per_step(jobs: list[tuple[str, dict | None]], steps: int, base: int) -> list[float]:
    """Instructions per step of each job: (count at steps - count at base) / (steps - base)."""
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        runs = [(job, n) for job in jobs for n in (steps, base)]
        totals = list(pool.map(lambda r: count(r[0][0], r[1], r[0][1], Path(tmp)), runs))
    return [(totals[2 * i] - totals[2 * i + 1]) / (steps - base) for i in range(len(jobs))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="steps of the long run (600)")
    parser.add_argument("--base", type=int, default=100, help="steps of the short run (100)")
    parser.add_argument(
        "--attribute", action="store_true", help="also bench/loop.py's attribution variants"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, steps, changes = json.loads(args.child)
        child(name, steps, changes)
        return 0
    if not 10 <= args.base < args.steps:
        parser.error("--base must be >= 10 and below --steps")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt-get install valgrind)")
    import torch

    import loop

    torch.set_num_threads(1)  # as in every child: environment() reports it
    jobs: list[tuple[str, dict | None]] = [(name, None) for name in CONTENDERS]
    labels = list(CONTENDERS)
    if args.attribute:
        jobs += [(variant, None) for variant in loop.ATTRIBUTION]
        labels += list(loop.ATTRIBUTION)
    counts = per_step(jobs, args.steps, args.base)
    raw = counts[0]
    rows = [
        [label, f"{n:,.0f}", f"{n - raw:+,.0f}", f"{n / raw:.3f}", _target(label)]
        for label, n in zip(labels, counts, strict=True)
    ]
    print(
        f"CPU instructions per step (callgrind; runs of {args.steps} and {args.base} steps, "
        "the difference per step)"
    )
    print(environment())
    print()
    print(format_table(["contender", "instructions", "over raw", "x raw", "time target"], rows))
    return 0


def _target(label: str) -> str:
    import loop

    target = loop.TARGETS.get(label)
    return f"<= {target:.2f}x" if target else ""


if __name__ == "__main__":
    sys.exit(main())
