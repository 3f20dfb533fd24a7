"""Random requests on random ranks at random moments of a step, for the agreement fuzz
(launched by torchrun from tests/test_agreement_fuzz.py; not collected).

One training run of ``STEPS`` steps in one process group: every step is a trial. At each
event of a step, each rank draws (from its own seed) whether to file a request and of
which kind: log, evaluate, save, a valued kind and a plain kind of the fuzz's own, and
near the end a stop. A thread on each rank files a valued kind at moments of its own.
Each rank writes what it filed and what the loop acted on, at which step, for the test
to compare.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from pathlib import Path

from hookloop.config import apply_overrides
from hookloop.distributed import init_from_env, leave_process_group, rank_info
from hookloop.entry import build_trainer
from hookloop.loop.actions import register_action
from hookloop.recipes import default_config
from hookloop.requests import register_kind

#: The events at which a rank may file (every moment of a step the loop has).
MOMENTS = ("on_train_step_start", "on_micro_step_start", "on_micro_step_end",
           "on_before_optimizer_step", "on_after_optimizer_step", "on_train_step_end")  # fmt: skip
KINDS = ("log", "evaluate", "save", "fuzz_valued", "fuzz_plain")


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    init_from_env()
    rank, _, world = rank_info()
    register_kind("fuzz_valued", "a request of the fuzz that carries values")
    register_kind("fuzz_plain", "a request of the fuzz without values")
    register_kind("fuzz_thread", "a valued request filed from another thread")
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, [
        f"train.max_steps={steps + 50}", "train.log_every=100000", "train.eval_every=100000",
        "train.grad_accum=2", "data.batch_size=4", "data.train_samples=256",
        "data.eval_samples=8", "checkpoint.every=100000",
    ])  # fmt: skip
    trainer = build_trainer(cfg, out_dir=None)
    draw = random.Random(1000 + rank)
    filed: list[list] = []  # [step, moment, kind, values]
    acted: list[list] = []  # [step, kind, values]

    def act(kind):
        return lambda t, values: acted.append([t.state.step, kind, dict(values)])

    for kind in ("fuzz_valued", "fuzz_plain", "fuzz_thread"):
        register_action(kind, act(kind))
    trainer.callbacks.register("on_log", lambda ctx: acted.append([ctx.state.step, "log", {}]))
    trainer.callbacks.register(
        "on_eval_end", lambda ctx: acted.append([ctx.state.step, "evaluate", {}])
    )

    def maybe_file(moment):
        def handler(ctx):
            step = ctx.state.step
            if step > steps:
                return
            if draw.random() < 0.04:
                kind = draw.choice(KINDS)
                values = {"rank": rank, "n": draw.randrange(1000)} if kind == "fuzz_valued" else {}
                ctx.control.request(kind, **values)
                filed.append([step, moment, kind, values])
            if step == steps and moment == "on_after_optimizer_step" and rank == world - 1:
                ctx.control.request_stop(f"stop from rank {rank}")
                filed.append([step, moment, "stop", {}])

        return handler

    for moment in MOMENTS:
        trainer.callbacks.register(moment, maybe_file(moment))
    done = threading.Event()

    def from_a_thread():
        thread_draw = random.Random(2000 + rank)
        while not done.wait(thread_draw.random() * 0.01):
            trainer.control.request("fuzz_thread", rank=rank, n=thread_draw.randrange(1000))

    thread = threading.Thread(target=from_a_thread, daemon=True)
    thread.start()
    result = trainer.train()
    done.set()
    thread.join(timeout=10)
    record = {"rank": rank, "step": result.step, "stop_reason": result.stop_reason,
              "filed": filed, "acted": acted, "skipped": trainer.state.skipped_steps}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fuzz-rank{rank}.json").write_text(json.dumps(record))
    leave_process_group()
    sys.stdout.flush()
    os._exit(0)  # see tests/_dist_job.py's finish(): torch's teardown is not under test


if __name__ == "__main__":
    main()
