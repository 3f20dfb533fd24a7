"""A training job for the multi-process tests, launched by torchrun (not collected)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from hookloop import Trainer
from hookloop.config import apply_overrides
from hookloop.distributed import full_tensor, init_from_env, leave_process_group, rank_info
from hookloop.entry import build_trainer, load_weights, seed_everything
from hookloop.loop.actions import register_action
from hookloop.recipes import default_config, get_recipe
from hookloop.requests import register_kind


def trainer_with_own_optimizer(cfg) -> Trainer:
    """The Python-API path: the user builds the optimizer before the Trainer (and any sharding)."""
    seed_everything(cfg.seed)
    parts = get_recipe(cfg.recipe).build(cfg)
    optimizer = torch.optim.SGD(
        parts.model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum
    )
    return Trainer(parts.model, optimizer, train_data=parts.train_data,
                   eval_data=parts.eval_data, loss_fn=parts.loss_fn, config=cfg)  # fmt: skip


def trainer_that_fits_less_on_rank_1(cfg, rank: int) -> Trainer:
    """data.batch_size=auto where rank 1 runs out of memory above 16 rows, rank 0 never."""
    seed_everything(cfg.seed)
    parts = get_recipe(cfg.recipe).build(cfg)

    def oom_above_16(module, args):
        if rank == 1 and args[0].shape[0] > 16:
            raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1)")

    parts.model.register_forward_pre_hook(oom_above_16)
    return Trainer(parts.model, train_data=parts.train_data, loss_fn=parts.loss_fn, config=cfg)


def main() -> None:
    mode, out, *overrides = sys.argv[1:]
    init_from_env()
    rank, _, world = rank_info()
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, ["train.log_every=1", *overrides])
    if mode == "own-optimizer":
        trainer = trainer_with_own_optimizer(cfg)
    elif mode == "auto-batch":
        trainer = trainer_that_fits_less_on_rank_1(cfg, rank)
    else:
        trainer = build_trainer(cfg, out_dir=out if mode != "plain" else None,
                                resume="auto" if mode == "resume" else None)  # fmt: skip
    losses: dict[int, float] = {}

    def record(ctx) -> None:
        if "loss" in ctx.logs:  # absent when every step since the last log was skipped
            losses[ctx.state.step] = ctx.logs["loss"]

    trainer.callbacks.register("on_log", record)
    applied: list[list[float]] = []  # [step, factor] where a valued request was acted on
    settings: list[list] = []  # [step, changes, lr, clip] where a live set was applied
    if mode == "stop-on-rank-1":
        trainer.callbacks.register(
            "on_train_step_end",
            lambda ctx: ctx.control.request_stop("asked on rank 1") if rank == 1 else None,
            once=7,
        )
        # A request that carries a value, filed on rank 1 alone at step 4 (as the control
        # server files on rank 0 alone): every rank acts on it at the same step.
        register_kind("scale_lr", "multiply every parameter group's learning rate")

        def scale_lr(trainer, values) -> None:
            for group in trainer.optimizer.param_groups:
                group["lr"] *= values["factor"]
            applied.append([trainer.state.step, values["factor"]])

        register_action("scale_lr", scale_lr)
        # A live `set`, filed on rank 0 alone at step 5 as the control server files it.
        trainer.callbacks.register(
            "on_train_step_end",
            lambda ctx: (
                ctx.control.request(
                    "set", **{"1": {"values": {"lr": 0.02, "clip_grad_norm": 0.3}, "client": "t"}}
                )
                if rank == 0
                else None
            ),
            once=5,
        )
        trainer.callbacks.register(
            "on_settings_change",
            lambda ctx: settings.append(
                [
                    ctx.state.step,
                    [[c.key, c.new] for c in ctx.changes],
                    ctx.optimizer.param_groups[0]["lr"],
                    trainer.stepper.clipping.max_norm,
                ]
            ),
        )
        trainer.callbacks.register(
            "on_train_step_end",
            lambda ctx: ctx.control.request("scale_lr", factor=0.25) if rank == 1 else None,
            once=4,
        )
    if mode == "diloco":
        from hookloop.callbacks.diloco import DiLoCo

        diloco = DiLoCo(sync_every=4, outer_lr=0.7, outer_momentum=0.5, bf16_comm=True)
        trainer.callbacks.add(diloco)
        synced: list[list[float]] = []
        trainer.callbacks.register(
            "on_train_step_end",
            lambda ctx: synced.append(
                [float(p.detach().double().sum()) for p in ctx.model.parameters()]
            ),
            every=4,
            priority=90,  # after DiLoCo (15) took its outer step
        )
    if mode == "nan-on-rank-1":
        micro_step = trainer.stepper.micro_step
        forward = micro_step.forward

        def poisoned(state, data, model):
            output, loss_func = forward(state, data, model)
            if rank == 1 and state.step == 3:
                return output, lambda out: (loss_func(out)[0] * math.nan, {})
            return output, loss_func

        micro_step.forward = poisoned
    if mode == "load-weights":  # no training: report the weights read from <out>/weights-from
        load_weights(trainer.model, (Path(out) / "weights-from").read_text())
        finish(out, mode, rank, world, {"params": whole_params(trainer)})
        return
    if mode == "skip-on-rank-1":  # a callback that decides from rank 1's own values
        trainer.callbacks.register(
            "on_before_optimizer_step",
            lambda ctx: ctx.control.skip_step() if rank == 1 and ctx.state.step == 3 else None,
        )
    if mode == "kind-on-rank-1" and rank == 1:  # a plug-in imported on rank 1 alone
        register_kind("only_on_rank_1", "a kind the other ranks never registered")
    if mode in ("kind-on-rank-1", "skip-on-rank-1"):
        try:
            trainer.train()
        except RuntimeError as err:  # KindsDiffer or SkipsDiffer, on every rank
            finish(out, mode, rank, world, {"error": f"{type(err).__name__}: {err}"})
            return
    result = trainer.train()
    record = {
        "rank": rank,
        "world": world,
        "step": result.step,
        "stop_reason": result.stop_reason,
        "skipped": trainer.state.skipped_steps,
        "losses": losses,
        "params": whole_params(trainer),
        "eval_loss": result.metrics.get("eval_loss"),
        "batch_size": cfg.data.batch_size,
    }
    if mode == "stop-on-rank-1":
        record["applied"] = applied
        record["settings"] = settings
        record["lr"] = trainer.optimizer.param_groups[0]["lr"]
    if mode == "diloco":
        record["synced"] = synced
        record["outer_steps"] = diloco.outer_steps
    finish(out, mode, rank, world, record)


def whole_params(trainer: Trainer) -> list[list[float]]:
    """Whole values (gathered from the shards under fsdp), so every rank reports the same."""
    return [full_tensor(p.detach()).flatten().tolist() for p in trainer.model.parameters()]


def finish(out: str, mode: str, rank: int, world: int, record: dict) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"result-{mode}-rank{rank}.json").write_text(json.dumps(record))
    if world > 1:
        # Every rank done with its collectives before any tears the group down, and every
        # group torn down before any rank exits: either race once killed a rank (SIGABRT).
        leave_process_group()
        # This rank's result is on disk and its group is gone; all that is left is the
        # interpreter's own teardown. In three fresh-clone suite runs a rank of this job
        # died there of SIGABRT ("terminate called without an active exception", in C++ with
        # no Python frame left), never in 200-odd runs of the job alone. The tests ask about
        # training, not about torch's teardown: leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
