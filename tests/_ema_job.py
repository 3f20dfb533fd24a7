"""Two ranks (gloo) training with EMA, launched by torchrun (not collected).

``_ema_job.py OUT``: DDP with ``callbacks.ema_decay`` (as ``hookloop train``); each
rank writes its averages and weights to ``OUT/ema-rank<r>.json``.

``_ema_job.py fsdp OUT [overrides]``: FSDP2 (``train.parallel=fsdp``), three runs in turn:
``OUT/ref`` to the end, ``OUT/run`` stopped at step 6 (``train.exit_interval``), and
``OUT/plain`` without EMA to step 4. ``_ema_job.py resume OUT [overrides]`` resumes
``OUT/run`` and ``OUT/plain`` (with EMA), those of them that are there. Each run writes
``OUT/<leg>-rank<r>.json``: the averages, the trained and final weights (gathered), the
average computed by hand from the gathered weights (unless it resumed averages), the last
evaluation's loss and the weights it ran with, and each average's local and whole size.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from _resign import resign
from hookloop import Callback
from hookloop.callbacks import EMA, default_callbacks
from hookloop.config import apply_overrides
from hookloop.distributed import full_tensor, init_from_env, leave_process_group, rank_info
from hookloop.entry import build_trainer
from hookloop.recipes import default_config

#: The FSDP2 runs: 12 steps of 12 samples (6 per rank), evaluated and saved every 4.
FSDP = ["train.parallel=fsdp", "train.max_steps=12", "train.log_every=0", "train.eval_every=4",
        "checkpoint.every=4", "data.train_samples=128", "data.eval_samples=32",
        "data.batch_size=6", "logging.progress=false"]  # fmt: skip
DECAY, EVERY, START = 0.9, 2, 1


def whole(named) -> dict[str, list[float]]:
    """Whole values by name (gathered from the shards under FSDP2: every rank calls it)."""
    return {n: full_tensor(t.detach()).flatten().tolist() for n, t in named}


class Recorder(Callback):
    """What the FSDP2 test compares; collectives inside, so every rank records."""

    priority = 11  # before EMA (12): the weights it sees are the trained ones

    def __init__(self, by_hand: bool) -> None:
        self.by_hand: dict[str, torch.Tensor] | None = {} if by_hand else None
        self.trained: dict[str, list[float]] = {}
        self.eval_weights: dict[str, list[float]] = {}

    def on_train_start(self, ctx) -> None:
        if self.by_hand is not None:
            self.by_hand = self.gathered(ctx.model)

    def on_after_optimizer_step(self, ctx) -> None:
        if self.by_hand is None:
            return
        step, weights = ctx.state.step, self.gathered(ctx.model)
        if step <= START:
            self.by_hand = weights
        elif (step - START) % EVERY == 0:  # the same float32 lerp, on whole tensors
            for name, w in weights.items():
                self.by_hand[name].lerp_(w, 1 - DECAY)

    def on_train_end(self, ctx) -> None:
        self.trained = whole(ctx.model.named_parameters())

    @staticmethod
    def gathered(model) -> dict[str, torch.Tensor]:
        return {n: full_tensor(p.detach()).float().clone() for n, p in model.named_parameters()}


class EvalWeights(Callback):
    """The weights each evaluation runs with (after EMA swapped the averages in)."""

    priority = 13

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_eval_start(self, ctx) -> None:
        self.recorder.eval_weights = whole(ctx.model.named_parameters())


def fsdp_run(leg: str, out: Path, overrides: list[str], *, resume: bool, ema: bool) -> dict:
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, [*FSDP, *overrides])
    recorder = Recorder(by_hand=not resume or leg == "plain")  # plain: no averages saved
    callbacks: list[Callback] = [recorder, EvalWeights(recorder)]
    if ema:
        callbacks.append(EMA(DECAY, every=EVERY, start_step=START, swap_at_end=True))
    trainer = build_trainer(cfg, callbacks=callbacks, out_dir=out / leg,
                            resume="auto" if resume else None)  # fmt: skip
    result = trainer.train()
    if not ema:
        return {"step": result.step}
    average = callbacks[-1]
    assert isinstance(average, EMA)
    return {
        "step": result.step,
        "updates": average.updates,
        "averages": {n: t.flatten().tolist() for n, t in average.averaged_state_dict().items()},
        "by_hand": {n: t.flatten().tolist() for n, t in (recorder.by_hand or {}).items()},
        "trained": recorder.trained,
        "model": whole(trainer.model.named_parameters()),
        "eval_loss": result.metrics.get("eval_loss"),
        "eval_weights": recorder.eval_weights,
        "sizes": {n: [t.to_local().numel(), t.numel()] for n, t in average.averages.items()},
    }


def ddp_run() -> dict:
    cfg = default_config("mlp-regression")
    apply_overrides(
        cfg,
        [
            "train.max_steps=6",
            "train.log_every=0",
            "train.eval_every=3",
            "callbacks.ema_decay=0.9",
            "logging.progress=false",
        ],
    )
    trainer = build_trainer(cfg, callbacks=default_callbacks(cfg, None))  # as `hookloop train`
    (ema,) = [cb for cb in trainer.callbacks.callbacks if isinstance(cb, EMA)]
    trainer.train()
    return {
        "updates": ema.updates,
        "averages": {n: t.flatten().tolist() for n, t in ema.averaged_state_dict().items()},
        "weights": whole(getattr(trainer.model, "module", trainer.model).named_parameters()),
    }


def main() -> None:
    mode, out, *overrides = (
        sys.argv[1:] if sys.argv[1] in ("fsdp", "resume") else ["ddp", *sys.argv[1:]]
    )
    init_from_env()
    rank, _, world = rank_info()
    records = {}
    if mode == "ddp":
        records["ema"] = ddp_run()
    elif mode == "fsdp":
        records["ref"] = fsdp_run("ref", Path(out), overrides, resume=False, ema=True)
        stop = [*overrides, "train.exit_interval=6"]
        records["run"] = fsdp_run("run", Path(out), stop, resume=False, ema=True)
        plain = [*overrides, "train.max_steps=4"]
        records["plain"] = fsdp_run("plain", Path(out), plain, resume=False, ema=False)
        if rank == 0:  # what the 3-rank resume starts from; plain as an older hookloop wrote it
            shutil.copytree(Path(out) / "run", Path(out) / "three" / "run")
            resign(Path(out) / "plain" / "checkpoints" / "step-00000004", fmt=3)
        torch.distributed.barrier()
    if mode in ("fsdp", "resume"):  # resumed in the same launch: one process group fewer
        for leg in ("run", "plain"):
            if (Path(out) / leg).is_dir():
                records[f"{leg}-resumed"] = fsdp_run(
                    leg, Path(out), overrides, resume=True, ema=True
                )
    for leg, record in records.items():
        (Path(out) / f"{leg}-rank{rank}.json").write_text(json.dumps({"world": world, **record}))
    leave_process_group()
    sys.stdout.flush()
    os._exit(0)  # as tests/_dist_job.py: the result is written; skip torch's teardown


if __name__ == "__main__":
    main()
