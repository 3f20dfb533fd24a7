"""Megatron-Bridge's ``training.train`` as a run of hookloop's own loop.

:func:`build_trainer` makes a :class:`hookloop.loop.Trainer` over the objects the user
built (their model chunk, optimizer and scheduler) with the dialect's parts:

- the data (:class:`StepPlaceholders`): Megatron's forward step reads its micro-batch
  from the user's iterator itself, so the loop draws placeholders, one per micro-batch
  (each counting ``train.micro_batch_size`` samples); a step listed in
  ``train.iterations_to_skip`` reads its micro-batches from the user's iterator here
  and drops them, and the loop's :class:`~hookloop.loop.schedule.Schedule` skips it;
- the micro-step (:class:`~.native_step.MegatronMicroStep`): the forward step on the
  user's iterator, the losses reduced as Megatron-Bridge reduces them;
- :class:`MegatronStepWork`, a native callback doing what Megatron-Bridge's loop does
  after each step, in its order: the log line and writers, the validation when due,
  the post-step work, and the exit conditions the native loop does not count itself
  (the time since ``state.start_time``, straggler detection), asked as a stop that the
  loop agrees across ranks.

Everything else is the native loop's: the step (one backward, clip and update), the
saves at ``checkpoint.save_interval`` and at an exit, ``exit_interval``, the exit
signal (``train.exit_signal``), requests agreed across ranks, live settings.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.eval import evaluate_and_print_results
from hookloop.compat.megatron_bridge.training.loggers import IntervalLosses, log_training_step
from hookloop.compat.megatron_bridge.training.megatron_core import (
    check_chunks,
    check_nvrx_straggler_detection,
    chunk_device,
)
from hookloop.compat.megatron_bridge.training.microbatches import microbatches
from hookloop.compat.megatron_bridge.training.native_step import (
    MegatronMicroStep,
    stepped_scheduler,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.config import Config
from hookloop.distributed import rank_info
from hookloop.loop import Trainer
from hookloop.loop.parts import Dialect
from hookloop.loop.records import Compute
from hookloop.loop.stepper import MicroStep
from hookloop.recipes.gpt import flops_per_sample
from hookloop.state import CallbackContext, Progress, TrainState

DataIterator = Iterator[Any] | None
NonLossData = tuple[
    Callable[[Any, int, Any], Any] | None,  # process_non_loss_data_func
    Callable[[Any], Any] | None,  # non_loss_data_func
]

#: The stop reasons of the exits :class:`MegatronStepWork` asks for.
DURATION, STRAGGLER = "exit_duration", "straggler"


def dummy_train_step(global_state: GlobalState, train_data_iterator: DataIterator) -> None:
    """Draw one step's micro-batches from ``train_data_iterator`` and drop them."""
    if train_data_iterator is None:
        return
    count = microbatches(global_state)
    for index in range(count):
        try:
            next(train_data_iterator)
        except StopIteration:
            raise RuntimeError(
                f"train_data_iterator ran out of data while skipping step "
                f"{global_state.train_state.step} (micro-batch {index + 1} of {count})"
            ) from None


def post_training_step_callbacks(
    model: list[torch.nn.Module],
    num_floating_point_operations_since_last_log_event: float,
    straggler_timer: Any,
    iteration: int,
    prof: torch.profiler.profile | None,
    config: Any,
    should_toggle_forward_pre_hook: bool,
    nsys_nvtx_context: Any = None,
) -> None:
    """What runs after each step: a CUDA sync every ``train.train_sync_interval`` steps,
    the straggler report every ``logger.log_interval`` steps (with a ``straggler_timer``
    and ``config.straggler.log_straggler``), one profiler step, and a garbage collection
    every ``train.manual_gc_interval`` steps with ``train.manual_gc``. Settings the
    config does not have are off; ``nsys_nvtx_context`` (Nsight ranges) is not used.
    """
    check_chunks(model)
    train_cfg = getattr(config, "train", None)
    sync_interval = getattr(train_cfg, "train_sync_interval", None)
    if sync_interval and iteration % sync_interval == 0 and torch.cuda.is_available():
        torch.cuda.synchronize()
    straggler = getattr(config, "straggler", None)
    log_interval = getattr(getattr(config, "logger", None), "log_interval", 0)
    if (
        straggler_timer is not None
        and getattr(straggler, "log_straggler", False)
        and log_interval
        and iteration % log_interval == 0
    ):
        straggler_timer.report(num_floating_point_operations_since_last_log_event, log_interval)
    if prof is not None:
        prof.step()
    gc_interval = getattr(train_cfg, "manual_gc_interval", 0)
    if getattr(train_cfg, "manual_gc", False) and gc_interval and iteration % gc_interval == 0:
        gc.collect()


class StepPlaceholders:
    """The train data the loop draws: one placeholder per micro-batch (its leading
    dimension the micro-batch size, so the loop counts the samples), endlessly.

    Before the first micro-batch of a step listed in ``train.iterations_to_skip`` it
    reads that step's micro-batches from the user's iterator and drops them, as
    Megatron-Bridge's dummy step does. ``progress`` (the loop's counters) is set once
    the loop is built.
    """

    def __init__(self, global_state: GlobalState, data_iterator: DataIterator) -> None:
        self.global_state, self.data_iterator = global_state, data_iterator
        self.count = microbatches(global_state)
        self.placeholder = torch.empty(global_state.cfg.train.micro_batch_size, 0)
        self.skip = frozenset(global_state.cfg.train.iterations_to_skip)
        self.progress: Any = None
        self.drawn = 0

    def __iter__(self) -> StepPlaceholders:
        return self

    def __next__(self) -> torch.Tensor:
        if self.skip and self.drawn % self.count == 0 and self.progress.step in self.skip:
            self.global_state.train_state.step = self.progress.step  # named in an error
            dummy_train_step(self.global_state, self.data_iterator)
        self.drawn += 1
        return self.placeholder


class MegatronStepWork(Callback):
    """What Megatron-Bridge's loop does after each step, in its order; and its skip rule.

    Before the update: with ``optimizer.clip_grad`` > 0 a non-finite gradient norm
    skips it. After the step: ``train_state`` counts it, the step is logged
    (:func:`~.loggers.log_training_step`), validation runs every ``train.eval_interval``
    steps, then :func:`post_training_step_callbacks`, then
    a stop is asked when ``train.exit_duration_in_mins`` has passed since
    ``state.start_time`` or a straggler was detected.
    """

    priority = 60  # after the Megatron-Bridge callbacks of on_train_step_end

    def __init__(
        self,
        global_state: GlobalState,
        model: list[torch.nn.Module],
        step_func: Callable[..., Any],
        valid_data_iterator: DataIterator,
        non_loss_data: NonLossData,
        manager: CallbackManager,
    ) -> None:
        self.global_state, self.model, self.step_func = global_state, model, step_func
        self.valid_data_iterator, self.non_loss_data = valid_data_iterator, non_loss_data
        self.manager = manager
        self.interval_losses = IntervalLosses()
        cfg = global_state.cfg
        self.clips = cfg.optimizer.clip_grad > 0
        self.flops_since_log = 0.0

    def on_before_optimizer_step(self, ctx: CallbackContext) -> None:
        norm = ctx.grad_norm
        if self.clips and norm is not None and not math.isfinite(float(norm)):
            ctx.control.skip_step()  # Megatron's optimizer reports an unsuccessful update

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        state, cfg = self.global_state, self.global_state.cfg
        before = state.train_state.floating_point_operations_so_far
        state.refresh(ctx.state)  # the step is counted now, as Megatron-Bridge counts it
        ts = state.train_state
        self.flops_since_log += ts.floating_point_operations_so_far - before
        skipped = bool(ctx.skipped_iter)
        norm = ctx.grad_norm
        grad_norm = None if norm is None or skipped or not self.clips else float(norm)
        losses = ctx.loss_dict or {}
        log_training_step(state, losses, grad_norm, ctx.optimizer, self.interval_losses, skipped)
        interval = cfg.train.eval_interval
        if ts.do_valid and interval and ts.step % interval == 0:
            self.validate()
        post_training_step_callbacks(
            self.model, self.flops_since_log, None, ts.step, None, cfg, False, None
        )
        reason = self.exit_reason()
        if reason is not None:
            ctx.control.request_stop(reason)

    def exit_reason(self) -> str | None:
        """The exit this rank sees that the loop does not count itself (None: none)."""
        state = self.global_state
        minutes = state.cfg.train.exit_duration_in_mins
        if minutes and (time.time() - state.start_time) / 60.0 > minutes:
            return DURATION
        if check_nvrx_straggler_detection(state.nvrx_straggler_manager):
            return STRAGGLER
        return None

    def validate(self) -> None:
        """One validation pass, the ``interval-time`` timer paused meanwhile (and, with
        ``train.manual_gc`` and ``manual_gc_eval``, a collection before and after)."""
        state = self.global_state
        interval_time = state.timers("interval-time")
        running = interval_time.active
        if running:
            interval_time.stop()
        train_cfg = state.cfg.train
        collect = train_cfg.manual_gc and train_cfg.manual_gc_eval
        if collect:
            gc.collect()  # everything, before validation
        process, produce = self.non_loss_data
        evaluate_and_print_results(
            state,
            f"iteration {state.train_state.step}",
            self.step_func,
            self.valid_data_iterator,
            self.model,
            state.cfg.model,
            process_non_loss_data_func=process,
            non_loss_data_func=produce,
            callback_manager=self.manager,
        )
        if collect:
            gc.collect(generation=0)  # what validation made and dropped
        if running:
            interval_time.start()


def native_config(cfg: ConfigContainer, device: torch.device) -> Config:
    """The native config of a ``training.train`` run on the user's own objects.

    No scheduler of the config's (the user's, or none), no save at the end but at an
    exit (Megatron-Bridge's ``train`` saves at intervals and exits), every checkpoint
    kept; validation, the log line and the time limit are :class:`MegatronStepWork`'s;
    the exit signal is caught only with ``train.exit_signal_handler``.
    """
    native = cfg.to_native(world_size=rank_info()[2])
    train = dataclasses.replace(
        native.train,
        device=str(device),
        parallel="local",  # the user's model comes wrapped as they want it (DDP, say)
        eval_every=None,
        log_every=0,  # the log line is MegatronStepWork's
        exit_duration_minutes=None,
        skip_nonfinite=False,  # Megatron's rule: MegatronStepWork.on_before_optimizer_step
        max_skipped_fraction=None,
        handle_signals=cfg.train.exit_signal_handler,
    )
    return dataclasses.replace(
        native,
        train=train,
        scheduler=dataclasses.replace(native.scheduler, name="constant", warmup_steps=0),
        checkpoint=dataclasses.replace(native.checkpoint, keep_last=None, save_on_end=False),
    ).validate()


def build_trainer(
    global_state: GlobalState,
    step_func: Callable[..., Any],
    model: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: StepPlaceholders,
    manager: CallbackManager,
) -> Trainer:
    """The loop of one ``training.train`` call; ``global_state`` follows its counters."""
    cfg = global_state.cfg
    chunk = check_chunks(model)[0]
    native = native_config(cfg, chunk_device(model))
    global_state.native_config = native  # the callbacks' contexts carry this state

    def micro_step(compute: Compute, progress: Progress) -> MicroStep:
        state = TrainState(progress)

        def forward(data_iterator: DataIterator, chunk: Any) -> Any:
            global_state.refresh(state, in_step=True)  # the step not counted yet
            return step_func(data_iterator, chunk)

        return MegatronMicroStep(forward, data.data_iterator, compute.precision, data.count)

    parameters = sum(p.numel() for p in chunk.parameters())
    trainer = Trainer(
        chunk,
        optimizer,
        train_data=data,
        config=native,
        callbacks=manager.native,
        scheduler=stepped_scheduler(scheduler, cfg.train.global_batch_size),
        out_dir=cfg.checkpoint.save,
        flops_per_sample=flops_per_sample(cfg.gpt_config(), parameters),
        # Megatron's exit signal alone, not SIGTERM and SIGINT
        dialect=Dialect(micro_step=micro_step, stop_signals=(cfg.train.exit_signal,)),
    )
    data.progress = trainer.progress
    global_state.refresh(trainer.state)  # state.timers are the loop's from here on
    return trainer
