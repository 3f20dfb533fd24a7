"""``pretrain(config, forward_step_func, callbacks=...)`` in Megatron-Bridge's shape.

``config`` is a Megatron-Bridge-shaped :class:`ConfigContainer` (``cfg.train.train_iters``
…) or a native :class:`hookloop.Config`. The callbacks (a list or a dialect
``CallbackManager``) become native registrations; the forward step receives
the run's :class:`GlobalState` as its first argument, the same object the
callbacks see as ``context.state``, with the TensorBoard and W&B writers the
config enables. The entry point logs through them too (Megatron-Bridge's logging
integration): each log step's numbers and each evaluation's. When the run has
test data (a container's ``dataset.split`` with a test weight, or a recipe
that gives test data) and training finished its budget, the test phase runs at
the end, firing the ``on_test_*`` events, as Megatron's entry point does; its
``test_*`` metrics join the result's.

After the steps, as Megatron-Bridge's ``pretrain``: when training finished its
budget, one more validation pass over the valid data (after ``on_train_end``),
then the test pass. When an exit condition ended training (``exit_interval``,
``exit_duration_in_mins``, a signal) the checkpoint is saved and ``SystemExit(0)``
is raised, without ``on_train_end``, the final validation or the test pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hookloop import entry
from hookloop.compat.megatron_bridge.training import non_loss_data
from hookloop.compat.megatron_bridge.training.callbacks import (
    Callback,
    CallbackManager,
    as_manager,
)
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.loggers import LogToWriters, Writers
from hookloop.compat.megatron_bridge.training.native_events import exited
from hookloop.compat.megatron_bridge.training.progress import MegatronBridgeProgressLog
from hookloop.compat.megatron_bridge.training.sample_counts import ValidSampleCounter
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.config import Config
from hookloop.distributed import rank_info
from hookloop.loop import Trainer
from hookloop.optim import build_optimizer, build_scheduler
from hookloop.result import TrainResult
from hookloop.state import TrainState
from hookloop.step import bind_forward_step

ForwardStepFunc = Callable[..., tuple[Any, Callable[..., Any]]]
Callbacks = CallbackManager | Iterable[Callback] | None
#: Megatron-Bridge's ConfigContainer or hookloop's own Config: either drives a run.
AnyConfig = ConfigContainer | Config

#: Stop reasons after which the test phase runs (the budget was spent, nothing cut it short).
FINISHED = ("max_steps", "max_epochs")


def pretrain(
    config: AnyConfig,
    forward_step_func: ForwardStepFunc,
    callbacks: Callbacks = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    process_non_loss_data_func: Callable[[Any, int, Any], Any] | None = None,
) -> TrainResult:
    """Train ``config``'s model from scratch with ``forward_step_func``.

    ``forward_step_func(global_state, data_iterator, model, return_schedule_plan=False)``
    returns ``(output, loss_func)``. ``out_dir`` and ``resume`` are hookloop's
    (checkpoints under ``out_dir``; ``resume="auto"`` continues the newest one);
    a container's ``checkpoint.save`` / ``checkpoint.load`` set them too.
    ``non_loss_data_func(model)`` runs after each evaluation (callbacks see its result
    as ``ctx.non_loss_data`` in ``on_eval_end``) and ``process_non_loss_data_func(data,
    iteration, writer)`` gets it with the TensorBoard writer (:mod:`.non_loss_data`).
    """
    return run(
        config,
        forward_step_func,
        callbacks,
        out_dir=out_dir,
        resume=resume,
        non_loss_data_func=non_loss_data_func,
        process_non_loss_data_func=process_non_loss_data_func,
    )


def run(
    config: AnyConfig,
    forward_step_func: ForwardStepFunc,
    callbacks: Callbacks,
    *,
    out_dir: str | Path | None,
    resume: str | None,
    pretrained: bool = False,
    non_loss_data_func: Callable[[Any], Any] | None = None,
    process_non_loss_data_func: Callable[[Any, int, Any], Any] | None = None,
) -> TrainResult:
    """One run of either entry point: train, test when due, close the writers."""
    non_loss_data.check(non_loss_data_func, process_non_loss_data_func)
    native, out_dir, resume = resolve(config, out_dir, resume)
    if pretrained and not native.checkpoint.pretrained and resume is None:
        raise ValueError(
            "finetune() needs pretrained weights: set config.checkpoint.pretrained (a hookloop "
            "Config) or config.checkpoint.pretrained_checkpoint (a ConfigContainer) to a "
            "checkpoint directory or a .safetensors file, or checkpoint.load to resume a "
            "fine-tuning run"
        )
    writers = Writers.for_run(config, out_dir)
    step, manager, global_state = prepare(config, forward_step_func, callbacks, native, writers)
    # This run's own native callbacks, taken off again at its end: a manager used for a
    # second run must not count or write into the first run's state.
    run_callbacks: list[Any] = [ValidSampleCounter(global_state)]
    if writers.enabled:
        run_callbacks.insert(0, log_to_writers(config, native, writers))
    if isinstance(config, ConfigContainer) and config.logger.log_progress:
        progress = MegatronBridgeProgressLog(global_state, async_save=config.checkpoint.async_save)
        run_callbacks.insert(-1, progress)
    for callback in run_callbacks:
        manager.native.add(callback)
    try:
        non_loss_data.register_processing(manager.native, global_state, process_non_loss_data_func)
        trainer = build_trainer(config, native, step, manager, out_dir=out_dir, resume=resume)
        trainer.non_loss_data_func = non_loss_data_func
        if pretrained and resume is None and native.checkpoint.pretrained:
            entry.load_weights(trainer.model, native.checkpoint.pretrained)
        result = trainer.train()
        if exited(result.stop_reason):
            raise SystemExit(0)  # Megatron-Bridge exits the process after saving
        if result.stop_reason in FINISHED:
            if trainer.eval_loader is not None:
                result.metrics.update(trainer.evaluate())  # the validation after training
            if trainer.test_loader is not None:
                result.metrics.update(trainer.test())
    finally:
        for callback in run_callbacks:
            manager.native.remove(callback)
        global_state.close_loggers()
    return result


def resolve(
    config: AnyConfig, out_dir: str | Path | None, resume: str | None
) -> tuple[Config, str | Path | None, str | None]:
    """The native config, run directory and resume target of ``config`` on this world size."""
    if isinstance(config, ConfigContainer):
        native = config.to_native(world_size=rank_info()[2])
        if config.train.iterations_to_skip:
            raise ValueError(
                "train.iterations_to_skip is honoured by training.train.train(); pretrain() and "
                "finetune() read their data from a recipe, each step's: leave it empty there"
            )
        ck = config.checkpoint
        out_dir = out_dir if out_dir is not None else (ck.save or ck.load)
        if resume is None and ck.load is not None:
            resume = "auto"  # Megatron's load: continue the newest checkpoint there, if any
        return native, out_dir, resume
    if isinstance(config, Config):
        return config.validate(), out_dir, resume
    raise TypeError(
        "config must be a hookloop Config (e.g. recipes.small_gpt_pretrain_config()) or a "
        f"ConfigContainer (e.g. recipes.tiny_gpt_pretrain_config()), got {type(config).__name__}"
    )


def prepare(
    config: AnyConfig,
    forward_step_func: ForwardStepFunc,
    callbacks: Callbacks,
    native: Config | None = None,
    writers: Writers | None = None,
) -> tuple[Callable[[TrainState, Iterator[Any], Any], Any], CallbackManager, GlobalState]:
    """The native forward step, the dialect manager and the GlobalState they share."""
    if not isinstance(config, (Config, ConfigContainer)):
        resolve(config, None, None)  # raises the TypeError naming what is allowed
    if not callable(forward_step_func):
        raise TypeError(
            "forward_step_func must be callable as (global_state, data_iterator, model, "
            f"return_schedule_plan=False), got {type(forward_step_func).__name__}"
        )
    manager = as_manager(callbacks)
    native = native if native is not None else resolve(config, None, None)[0]
    global_state = GlobalState(config, native_config=native, writers=writers)
    manager.native_events.share(global_state)
    call = bind_forward_step(forward_step_func)  # also accepts (data_iterator, model)

    def forward_step(state: TrainState, data_iterator: Iterator[Any], model: Any) -> Any:
        # The loop's own counters, whichever trainer runs this; a model in training mode
        # means a training step, where Megatron-Bridge has not counted the step yet.
        global_state.refresh(state, in_step=model.training)
        return call(global_state, data_iterator, model)

    return forward_step, manager, global_state


def build_trainer(
    config: AnyConfig,
    native: Config,
    step: Callable[..., Any],
    manager: CallbackManager,
    *,
    out_dir: str | Path | None,
    resume: str | None,
) -> Trainer:
    """The Trainer for the run: the native recipe's parts, or the container's split data."""
    if not isinstance(config, ConfigContainer):
        return entry.build_trainer(native, step, manager.native, out_dir=out_dir, resume=resume)
    from hookloop.compat.megatron_bridge.recipes.gpt import build_parts

    entry.seed_everything(native.seed)
    parts = build_parts(config, native)
    optimizer = build_optimizer(native.optimizer, parts.model)
    # Megatron-Bridge always has a scheduler; a constant rate gets one that keeps it.
    # It decays over scheduler.lr_decay_iters (or its samples), not always the whole run.
    decay_iterations = config.schedule_iterations()[1]
    scheduler = build_scheduler(native.scheduler, optimizer, decay_iterations)
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)
    return Trainer(
        parts.model,
        optimizer,
        scheduler=scheduler,
        train_data=parts.train_data,
        eval_data=parts.eval_data,
        test_data=parts.test_data,
        config=native,
        callbacks=manager.native,
        forward_step=step,
        out_dir=None if out_dir is None else str(out_dir),
        resume=resume,
        flops_per_sample=parts.flops_per_sample,
    )


def log_to_writers(config: AnyConfig, native: Config, writers: Writers) -> LogToWriters:
    """The run's logging to its writers, with its global batch size (Megatron's tags)."""
    if isinstance(config, ConfigContainer):
        return LogToWriters(
            writers,
            batch_size=config.train.global_batch_size,
            validation_ppl=config.logger.log_validation_ppl_to_tensorboard,
        )
    per_rank = getattr(native.data, "batch_size", None)
    batch = None if per_rank is None else per_rank * native.train.grad_accum * rank_info()[2]
    return LogToWriters(writers, batch_size=batch)


def _constant(step: int) -> float:
    """The LR factor of a constant schedule."""
    return 1.0
