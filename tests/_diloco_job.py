"""A DiLoCo training job for tests/test_diloco_server.py (run as a subprocess, not collected).

    python _diloco_job.py worker OUT INDEX WORKERS SERVER [KEY=VALUE ...]
    torchrun ... _diloco_job.py allreduce OUT 0 RANKS - [KEY=VALUE ...]
    torchrun ... _diloco_job.py ddp OUT 0 1 SERVER [KEY=VALUE ...]   (one worker, DDP inside)

Both train the small regression recipe without shuffling; worker INDEX of
WORKERS trains on the same samples as rank INDEX of an all-reduce job with
WORKERS ranks. Each writes ``result-<mode>-<index>.json``: the weights after
every outer step, the logged losses and its sync metrics. ``DILOCO_SLEEP``
(seconds) slows every step so a test can kill a process mid-run; ``DILOCO_POISON=nan``
makes the worker's weights NaN just before every sync (a faulty worker).

A worker takes its first step only once all WORKERS are registered: a round
waits for the workers registered when it opens, so with everyone in from the
start each round averages the same workers' contributions, whatever the load
on the machine, and the losses are the same from run to run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from torch.utils.data import Subset

from hookloop import Trainer
from hookloop.config import apply_overrides
from hookloop.distributed import init_from_env, leave_process_group, rank_info
from hookloop.entry import seed_everything
from hookloop.recipes import default_config, get_recipe

SYNC_EVERY = 4


def main() -> None:
    mode, out, index, workers, server, *overrides = sys.argv[1:]
    index, workers = int(index), int(workers)
    if mode in ("allreduce", "ddp"):
        init_from_env()
        index = rank_info()[0]
    cfg = default_config("mlp-regression")
    apply_overrides(
        cfg,
        ["data.shuffle=false", "data.batch_size=8", "data.train_samples=384",
         "train.log_every=1", "train.eval_at_epoch_end=false", "train.max_steps=12",
         "optimizer.name=sgd", "optimizer.lr=0.02", *overrides],
    )  # fmt: skip
    if mode == "allreduce":
        cfg.train.parallel = "local"
    seed_everything(cfg.seed)
    parts = get_recipe(cfg.recipe).build(cfg)
    train = parts.train_data
    if mode == "worker":  # the samples rank `index` of a `workers`-rank job would see
        train = Subset(train, range(index, len(train) - len(train) % workers, workers))
    trainer = Trainer(parts.model, train_data=train, loss_fn=parts.loss_fn, config=cfg)
    if mode == "allreduce":
        from hookloop.callbacks import DiLoCo

        diloco = DiLoCo(sync_every=SYNC_EVERY, outer_lr=0.7, outer_momentum=0.9)
    else:
        from hookloop.compat.hf import DiLoCoCallback  # Forgather's name and constructor

        diloco = DiLoCoCallback(
            server,
            SYNC_EVERY,
            "ddp-worker" if mode == "ddp" else f"w{index}",
            bf16_comm=os.environ.get("DILOCO_BF16_COMM") == "1",
            dylu=False,
            heartbeat_interval=0.25,
            num_fragments=1,
            timeout=60,
            max_sync_retries=8,
        )
    trainer.callbacks.add(diloco)
    if mode == "worker":
        trainer.callbacks.register(
            "on_train_start", lambda ctx: _wait_for_everyone(Path(out), index, workers), priority=90
        )  # after the DiLoCo callback (15) registered this worker
    synced: list[list[float]] = []
    losses: dict[int, float] = {}
    metrics: dict[str, float] = {}
    trainer.callbacks.register(
        "on_train_step_end",
        lambda ctx: synced.append(
            [v for p in ctx.model.parameters() for v in p.detach().flatten().tolist()]
        ),
        every=SYNC_EVERY,
        priority=90,  # after the DiLoCo callback (15) adopted the new global weights
    )

    def record(ctx) -> None:
        if "loss" in ctx.logs:
            losses[ctx.state.step] = ctx.logs["loss"]
        metrics.update({k: v for k, v in ctx.logs.items() if k.startswith("diloco/")})

    trainer.callbacks.register("on_log", record)
    if os.environ.get("DILOCO_POISON") == "nan":

        def poison(ctx) -> None:
            for param in ctx.model.parameters():
                param.data.fill_(float("nan"))

        trainer.callbacks.register("on_train_step_end", poison, every=SYNC_EVERY, priority=5)
    pause = float(os.environ.get("DILOCO_SLEEP", "0"))
    if pause:
        trainer.callbacks.register("on_train_step_end", lambda ctx: time.sleep(pause))
    result = trainer.train()
    record_file = Path(out) / f"result-{mode}-{index}.json"
    record_file.parent.mkdir(parents=True, exist_ok=True)
    record_file.write_text(
        json.dumps({"step": result.step, "synced": synced, "losses": losses, "metrics": metrics})
    )
    if mode in ("allreduce", "ddp"):
        leave_process_group()


def _wait_for_everyone(out: Path, index: int, workers: int) -> None:
    """Return once all ``workers`` workers have registered (bounded: 600 polls of 0.1 s).

    A file per registered worker, not the server's live count: a worker that joins last
    can train, be refused and leave before a slower one polls, and a count that went
    3 -> 2 would keep the others waiting for good."""
    (out / f"joined-{index}").touch()
    for _ in range(600):
        if sum((out / f"joined-{i}").exists() for i in range(workers)) >= workers:
            return
        time.sleep(0.1)
    raise RuntimeError(f"fewer than {workers} workers registered within 600 polls")


if __name__ == "__main__":
    main()
