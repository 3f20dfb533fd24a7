"""The training loop.

Read it top to bottom: ``train()`` → ``_run_epoch()`` → ``_train_step()`` →
``_step_boundary()``. The loop owns every decision (when to log, evaluate,
save, stop); callbacks observe through ``ctx`` and ask through ``ctx.control``.
Switch every callback off and the model still trains.

What is not the loop lives beside it: step mechanics and loss reduction in
:mod:`hookloop.step`, mixed precision in :mod:`hookloop.precision`, data order
and resume position in :mod:`hookloop.data`, checkpoint files in
:mod:`hookloop.checkpoint` (which receives named state, never the Trainer),
request draining and cross-rank agreement in :class:`~hookloop.state.Control`,
local checkpoints and what a resume picks in :mod:`hookloop.checkpoint.local`,
rolling back a divergence in :mod:`hookloop.checkpoint.rewind`. The Trainer's own methods
for checkpoints (save, load, rewind) and for evaluation (evaluate, test,
predict) are in :mod:`hookloop.trainer_checkpoints` and
:mod:`hookloop.trainer_evaluation`: this file is the training loop.

Hot-path rules: events are fired only when someone handles them (the payload
is not even built otherwise); loss, grad norm and finiteness stay tensors and
are read back to the host only on log steps, except the single finiteness
check that ``train.skip_nonfinite`` asks for.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.checkpoint import CheckpointManager
from hookloop.checkpoint.background import BackgroundSaves, HostCopy
from hookloop.checkpoint.local import local_manager
from hookloop.checkpoint.rewind import Rewinder
from hookloop.compile import check_can_compile, compile_loss, compile_module, unwrap_compiled
from hookloop.config import Config, TrainConfig
from hookloop.data import DataPosition, is_map_style, make_loader
from hookloop.distributed import (
    agree_flags,
    all_reduce_mean,
    broadcast_object,
    full_tensor,
    no_gradient_sync,
    parallelize,
    rank_info,
)
from hookloop.gcpolicy import GCPolicy
from hookloop.manager import CallbackManager
from hookloop.optim import build_optimizer, build_scheduler
from hookloop.precision import Precision
from hookloop.result import ExitCode, TrainResult
from hookloop.rundir import RunDir
from hookloop.runlock import RunDirLocked, run_lock
from hookloop.state import (
    NO_REQUESTS,
    CallbackContext,
    Control,
    Requests,
    RunInfo,
    SaveTiming,
    TrainState,
)
from hookloop.step import (
    FiniteCheck,
    LossReducer,
    LossWindow,
    batch_size_of,
    bind_forward_step,
    count_zeros,
    default_forward_step,
    gradient_clearer,
    gradients,
    optimizer_stepper,
    read_back,
    row_means,
    to_float,
)
from hookloop.timers import LOOP_TIMERS, NULL_TIMER, Timers, loop_clock, per_step_ms
from hookloop.trainer_checkpoints import TrainerCheckpoints
from hookloop.trainer_evaluation import TrainerEvaluation

__all__ = ["ExitCode", "TrainResult", "Trainer"]  # ExitCode, TrainResult: from hookloop.result

_NULL_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


class Trainer(TrainerCheckpoints, TrainerEvaluation):
    """Runs training, evaluation and testing for a model, firing events as it goes.

    ``config`` may be a full :class:`~hookloop.config.Config` or just its
    :class:`~hookloop.config.TrainConfig`. ``train_data`` may be a map-style
    dataset (wrapped in a resumable, seeded loader), a DataLoader, or any
    iterable of batches. Give ``forward_step(state, data_iterator, model)`` for
    full control, or ``loss_fn(outputs, targets)`` for ``(inputs, targets)``
    batches, or neither when the model returns its own loss. ``out_dir`` is the
    run directory (checkpoints and the loggers' files); ``resume`` is ``"auto"``
    or a checkpoint path.

    Public attributes: ``model`` (never wrapped), ``optimizer``, ``scheduler``,
    ``config``, ``callbacks`` (the manager), ``state``, ``control``, ``ctx``,
    ``device``, ``precision``, ``train_loader`` / ``eval_loader`` /
    ``test_loader``, ``flops_per_sample``, ``non_loss_data_func``, ``out_dir``, ``resume``,
    ``checkpoints`` (a CheckpointManager, or None without ``out_dir`` and
    ``resume``). Callbacks read the run's facts from ``ctx.run``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        train_data: Iterable[Any] | None = None,
        eval_data: Iterable[Any] | None = None,
        test_data: Iterable[Any] | None = None,
        config: Config | TrainConfig | None = None,
        callbacks: CallbackManager | Callback | Iterable[Callback] | None = None,
        forward_step: Any = None,
        loss_fn: Any = None,
        scheduler: Any = None,
        out_dir: str | Path | None = None,
        resume: str | None = None,
        flops_per_sample: float | None = None,
        non_loss_data_func: Any = None,
    ) -> None:
        _check_arguments(model, optimizer, forward_step, loss_fn)
        if non_loss_data_func is not None and not callable(non_loss_data_func):
            raise TypeError(
                f"non_loss_data_func must be callable(model), got {non_loss_data_func!r}"
            )
        self.config = _as_config(config).validate()
        self.callbacks = _as_manager(callbacks)
        self.callbacks.check_requirements()
        self.state = st = TrainState()
        st._rank, st._local_rank, st._world_size = rank_info()
        self.device = _resolve_device(self.config.train.device, st._local_rank)
        self._place_model(model, optimizer)
        self.out_dir = None if out_dir is None else str(out_dir)
        self.resume = resume
        # A figure in the config is the user's own: it wins over the recipe's estimate.
        self.flops_per_sample = _check_flops(self.config.train.flops_per_sample or flops_per_sample)
        self.non_loss_data_func = non_loss_data_func
        self.control = Control()
        self._open_data(train_data, eval_data, test_data)
        self.scheduler = (
            scheduler
            if scheduler is not None
            else build_scheduler(self.config.scheduler, self.optimizer, st.max_steps)
        )
        if self.config.train.compile:
            loss_fn = compile_loss(loss_fn)
        self._forward = bind_forward_step(
            forward_step or default_forward_step(loss_fn, self.device)
        )
        self.precision = Precision(self.config.train.precision, self.device)
        self.checkpoints = self._checkpoint_manager()
        self.local_checkpoints = self._local_checkpoint_manager()
        self._rewinder = Rewinder(st, self.config.train.grad_accum)  # hookloop.checkpoint.rewind
        self.ctx = CallbackContext(
            trainer=self,
            state=st,
            control=self.control,
            run=self._run_info(),
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            config=self.config,
            user_state=self.callbacks.user_state,
        )
        # The loop's own bookkeeping.
        self._hooks = self.callbacks.index  # live event -> handlers; empty tuple = unhandled
        self._reducer = LossReducer()
        self._losses = LossWindow(self.device)  # per-step losses since the last log
        self._finite_check = FiniteCheck(self.device)
        self._signal: int | None = None
        self._last_logs: dict[str, float] = {}
        self._last_eval_step = -1
        self._pending_tokens: list[Any] = []  # token counts not yet read back from the device
        self._saves, self._host_copy = BackgroundSaves(), HostCopy()  # checkpoint.async_save
        self._unlogged_saves: list[SaveTiming] = []  # saves committed since the last log
        self._gc = GCPolicy(self.config.train.gc_every, around_eval=self.config.train.gc_eval)
        self._start_timers()
        self._zeros: torch.Tensor | None = None  # zero gradient elements, counted on log steps
        self._last_graph: torch.Tensor | None = None  # the last loss (see _forward_backward)
        self._bind_optimizer_calls()  # and again when train() starts
        self._fire("on_init_end")

    # -- set-up helpers ------------------------------------------------------
    def _place_model(self, model: torch.nn.Module, optimizer: Any) -> None:
        # What users and callbacks see: never wrapped (but sharded in place under fsdp,
        # its parameters then DTensors). A model given compiled is unwrapped (hookloop.compile).
        model, compiled = unwrap_compiled(model)
        self.model = model.to(self.device)
        # What the training step runs: DDP-wrapped or FSDP2-sharded when there are several
        # ranks. Sharding replaces the parameters, so the optimizer is built afterwards.
        self._train_model = parallelize(
            self.model, self.config.train.parallel, self.device, optimizer
        )
        if self.config.train.compile or compiled is not None:
            if self.config.train.compile:
                check_can_compile(self.device)
            single = self._train_model is self.model and compiled is not None
            self._train_model = compiled if single else compile_module(self._train_model)
        self.optimizer = optimizer or build_optimizer(self.config.optimizer, self.model)

    def _open_data(self, train: Any, evaluation: Any, test: Any) -> None:
        self.train_loader = self._loader(train, train=True)
        self.eval_loader = self._loader(evaluation, train=False)
        self.test_loader = self._loader(test, train=False)
        self._plan_budget()
        self._data = DataPosition(  # the train data's position: what a resume restores
            self.train_loader if self.train_loader is not None else (),
            self.config.train.grad_accum,
        )

    def _loader(self, data: Iterable[Any] | None, *, train: bool) -> Iterable[Any] | None:
        if data is None:
            return None
        if is_map_style(data):
            dc = self.config.data
            return make_loader(
                data,
                batch_size=dc.batch_size if train else (dc.eval_batch_size or dc.batch_size),
                shuffle=dc.shuffle and train,
                seed=self.config.seed,
                rank=self.state.rank,
                world_size=self.state.world_size,
                num_workers=dc.num_workers,
                drop_last=train,
            )
        if not isinstance(data, Iterable):
            raise TypeError(
                f"{'train' if train else 'eval/test'} data must be a map-style Dataset, a "
                f"DataLoader or an iterable of batches, got {type(data).__name__}"
            )
        return data

    def _plan_budget(self) -> None:
        cfg, st = self.config.train, self.state
        batches = _batch_count(self.train_loader, None)
        st._steps_per_epoch = batches // cfg.grad_accum if batches is not None else None
        if st._steps_per_epoch == 0:
            raise ValueError(
                f"train data has {batches} batches per epoch, fewer than "
                f"train.grad_accum={cfg.grad_accum}: no optimizer step fits in an epoch"
            )
        st._num_epochs = cfg.max_epochs or (None if cfg.max_steps else 1)
        st._max_steps = cfg.max_steps
        if st._max_steps is None and st._steps_per_epoch is not None:
            st._max_steps = st._num_epochs * st._steps_per_epoch  # type: ignore[operator]

    def _checkpoint_manager(self) -> CheckpointManager | None:
        if self.out_dir is None and self.resume is None:
            return None
        # Resuming from a path without out_dir: the run it belongs to goes on saving there.
        run = RunDir(self.out_dir) if self.out_dir else RunDir.of_checkpoint(str(self.resume))
        return CheckpointManager.from_config(
            self.config.checkpoint, run.checkpoints, resuming=self.resume is not None
        )

    def _local_checkpoint_manager(self) -> CheckpointManager | None:
        """Local checkpoints (``checkpoint.local_every``) go beside the persistent ones."""
        if self.checkpoints is None:
            return None
        run = RunDir.of_checkpoint(self.checkpoints.storage.root)
        return local_manager(self.config.checkpoint, run, resuming=self.resume is not None)

    def _run_info(self) -> RunInfo:
        limit = self.config.train.eval_max_batches
        return RunInfo(
            dir=RunDir(self.out_dir) if self.out_dir is not None else None,
            device=self.device,
            resume=self.resume,
            can_checkpoint=self.checkpoints is not None,
            has_eval_data=self.eval_loader is not None,
            has_test_data=self.test_loader is not None,
            eval_batches=_batch_count(self.eval_loader, limit),
            test_batches=_batch_count(self.test_loader, limit),
        )

    def _start_timers(self) -> None:
        """``state.timers`` for everyone; the loop's own timers, or no-ops when off.

        A step reads ``self._clock`` once per boundary (data, forward-backward,
        optimizer) and adds each interval to its timer, instead of a start and a stop each.
        """
        mode = self.config.train.timers
        self.state._timers = Timers(sync=mode == "sync", device=self.device)
        self._clock = loop_clock(mode, self.device)
        self._t_data, self._t_fb, self._t_opt, self._t_eval, self._t_save = (
            NULL_TIMER if mode == "off" else self.state._timers(name)
            for name in LOOP_TIMERS  # data-iterator, forward-backward, optimizer, eval, save
        )
        self._last_log_step = 0

    def _bind_optimizer_calls(self) -> None:
        """The update and the gradient clearing the step calls, for ``self.optimizer``:
        torch's ``step()`` and ``zero_grad(set_to_none=True)`` without the profiler range
        each opens on every call, unless a profiler records (:mod:`hookloop.step`)."""
        optimizer, precision = self.optimizer, self.precision
        self._zero_grad = gradient_clearer(optimizer)
        if precision.scaler is None:
            self._apply_update = optimizer_stepper(optimizer)
        else:  # fp16: the GradScaler calls optimizer.step() itself, or skips it
            self._apply_update = functools.partial(precision.step, optimizer)

    def _fire(self, event: str) -> None:
        if self._hooks[event]:
            self.callbacks.fire(event, self.ctx)

    # -- training --------------------------------------------------------------
    def train(self) -> TrainResult:
        """Train until the step/epoch budget, a stop request, a signal or an exit condition.

        While it runs, the run directory is locked against a second writer.
        """
        if self.train_loader is None:
            raise ValueError("train() needs train_data; pass it to Trainer(train_data=...)")
        with self._run_dir_lock():
            return self._train()

    def _run_dir_lock(self) -> contextlib.AbstractContextManager[Any]:
        """Global rank 0 locks the run directory; every rank learns whether it could."""
        run = self.ctx.run.dir or (
            RunDir.of_checkpoint(self.checkpoints.storage.root) if self.checkpoints else None
        )
        if run is None:
            return _NULL_CONTEXT
        stack, error = contextlib.ExitStack(), None
        if self.state.is_rank_zero:
            try:
                stack.enter_context(run_lock(run.root))
            except RunDirLocked as err:
                error = str(err)
        if self.state._world_size > 1:
            error = broadcast_object(error)
        if error is not None:
            raise RunDirLocked(error)
        return stack

    def _train(self) -> TrainResult:
        cfg, st = self.config.train, self.state
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        self._skip_steps = frozenset(cfg.iterations_to_skip)
        self._next_scheduled = 0  # the first boundary works out when the next is due
        st._stop_reason, st._failed = None, False
        self._bind_optimizer_calls()  # to the optimizer trained with now
        self._start_time = time.monotonic()
        restore_signals = self._install_signal_handlers() if cfg.handle_signals else None
        try:
            if self.checkpoints is not None and self.resume is not None:
                self.load_checkpoint(self.resume)
            self._fire("on_data_init_start")  # model, optimizer, checkpoint ready; no data read
            self.model.train()
            st._in_training = True  # evaluations from here on are part of training
            self._fire("on_train_start")
            self._gc.begin()  # train.gc_every: collect on the loop's schedule from here on
            while st._stop_reason is None:
                if st._num_epochs is not None and st._epoch >= st._num_epochs:
                    st._stop_reason = "max_epochs"
                    break
                self._run_epoch()
            self._sync_tokens()
            self._check_skipped()
            if self.checkpoints is not None and self.checkpoints.due_at_end(st._stop_reason):
                self.save_checkpoint()  # not after an abort
            self._collect_saves(wait=True)  # the last commit and its event before on_train_end
            self._fire("on_train_end")
        except BaseException as exc:
            self._saves.finish_quietly()  # any exit waits for the checkpoint being written
            self.callbacks.fire_exception(self.ctx, exc)
            self.ctx.clear_event_fields()  # nothing stale for a later evaluate() or test()
            raise
        finally:
            self._last_graph = None  # a finished Trainer holds no autograd graph
            self._saves.close()
            self._gc.end()
            st._in_training = False
            if restore_signals:
                restore_signals()
        return TrainResult(
            step=st._step,
            epoch=st._epoch,
            stop_reason=st._stop_reason or "finished",
            signal=self._signal,
            failed=st._failed,
            metrics=dict(st._last_eval),
            logs=dict(self._last_logs),
        )

    def _run_epoch(self) -> None:
        """One pass over the training data (or the rest of it, after a resume)."""
        cfg, st, k = self.config.train, self.state, self.config.train.grad_accum
        micro_batches = self._rewinder.reposition(  # less what rewinds skipped in it
            self._data.epoch(st._epoch, st._epoch_step), st._epoch, self.train_loader
        )
        if st._epoch_step == 0:
            self._fire("on_epoch_start")
        clock, rewinder, collect_every = self._clock, self._rewinder, self._gc.every
        control, saves = self.control, self._saves
        while True:
            if st._max_steps is not None and st._step >= st._max_steps:
                st._stop_reason = "max_steps" if cfg.max_steps else "max_epochs"
                if st._epoch_step != st._steps_per_epoch:
                    return  # budget spent mid-epoch: no epoch end, so a longer resume is exact
                break
            fetching = clock()
            if rewinder.pending and rewinder.skip_due(st._step):
                rewinder.skip(micro_batches, st._epoch)  # the data after a divergence
            group = list(itertools.islice(micro_batches, k))
            if len(group) < k:  # epoch exhausted; a partial accumulation group is dropped
                self._t_data.add(clock() - fetching)
                break
            self._train_step(group, fetching)
            if collect_every is not None:
                self._gc.after_step(st._step)
            # The boundary has work only when a log, evaluation, save or exit interval is
            # due, or a request, a signal or a finished background save waits.
            if (
                st._step >= self._next_scheduled
                or st._will_log
                or control._pending
                or self._signal is not None
                or saves.busy
            ) and self._step_boundary():
                return  # stopped mid-epoch: no epoch-end events
        if self.eval_loader is not None and cfg.eval_at_epoch_end and not self._evaluated_now():
            self._evaluate_in_training()
        self._fire("on_epoch_end")
        st._epoch += 1
        st._epoch_step = 0
        self._epoch_boundary()

    def _train_step(self, group: list[Any], fetching: float | None = None) -> None:
        """One optimizer step over ``len(group)`` accumulated micro-batches, fetched
        since ``fetching`` (a reading of ``self._clock``; None: not timed)."""
        st, hooks, ctx, clock = self.state, self._hooks, self.ctx, self._clock
        fetched = clock()
        if fetching is not None:
            self._t_data.add(fetched - fetching)
        st._step += 1
        st._epoch_step += 1
        self.control._skip = False  # a skip filed after last step's update does not carry over
        st._will_log = self._log_due()
        per_rank = batch_size_of(group[0]) if len(group) == 1 else sum(map(batch_size_of, group))
        samples = per_rank * st._world_size
        st._samples += samples
        if self.flops_per_sample:
            st._flops += self.flops_per_sample * samples
        if st._step in self._skip_steps:
            return  # iterations_to_skip: data consumed, nothing computed
        computing = fetched
        if hooks["on_train_step_start"]:
            self.callbacks.fire("on_train_step_start", ctx)
            computing = clock()  # the timers leave the step-start handlers out
        reducer = self._reducer
        reducer.reset()
        self._forward_backward(group)
        computed = clock()
        self._t_fb.add(computed - computing)
        grad_norm = self._prepare_gradients()
        if st._will_log and self.config.train.log_num_zeros_in_grad:
            sharded = self.config.train.parallel == "fsdp" and st._world_size > 1
            self._zeros = count_zeros(gradients(self.optimizer), sharded=sharded)
        prepared = clock()
        loss_dict = reducer.result()
        if reducer.token_mode:
            self._pending_tokens.append(reducer.tokens)  # a tensor: summed when read
        ctx.loss_dict, ctx.grad_norm = loss_dict, grad_norm
        resumed = prepared
        if hooks["on_before_optimizer_step"]:
            self.callbacks.fire("on_before_optimizer_step", ctx)
            resumed = clock()  # the optimizer timer leaves the handlers out
        skipped = self._optimizer_step(loss_dict, grad_norm)
        # Two intervals, as the optimizer timer has always counted them.
        self._t_opt.add(prepared - computed + (clock() - resumed), intervals=2)
        if not skipped:  # a skipped step's (non-finite) loss stays out of the logged average
            self._losses.add(loss_dict, grad_norm, keep_all=bool(self.config.train.log_every))
        ctx.skipped_iter = skipped
        if hooks["on_after_optimizer_step"]:
            self.callbacks.fire("on_after_optimizer_step", ctx)
        if hooks["on_train_step_end"]:
            self.callbacks.fire("on_train_step_end", ctx)
        ctx.loss_dict = ctx.grad_norm = ctx.skipped_iter = None

    def _log_due(self) -> bool:
        """Whether this step will end with a log: scheduled, or asked for before it began.

        A log requested during the step is written at its end too, but producers
        learn of it only then. With several ranks a pending request is not
        counted here: the control server files them on rank 0 alone, and every
        rank must make the same decision.
        """
        every = self.config.train.log_every
        if every and self.state._step % every == 0:
            return True
        return self.state._world_size == 1 and self.control.log_requested

    def _forward_backward(self, group: list[Any]) -> None:
        """Forward, loss and backward for each micro-batch, firing the micro-step events."""
        st, hooks, ctx = self.state, self._hooks, self.ctx
        k, model, precision = len(group), self._train_model, self.precision
        data = iter(group)
        for i, batch in enumerate(group):
            st._micro_step = i
            if hooks["on_micro_step_start"]:
                ctx.batch = batch
                self.callbacks.fire("on_micro_step_start", ctx)
            # Gradients are reduced across ranks only on the last micro-batch of the step.
            last = i == k - 1
            if last and precision.dtype is None:  # fp32, no sync to hold: no context to enter
                output, loss = self._micro_step(st, data, model, k)
            else:
                with precision.autocast(), _NULL_CONTEXT if last else no_gradient_sync(model):
                    output, loss = self._micro_step(st, data, model, k)
            if hooks["on_micro_step_end"]:
                ctx.batch, ctx.outputs, ctx.loss = batch, output, loss.detach()
                self.callbacks.fire("on_micro_step_end", ctx)
                ctx.outputs = ctx.loss = None
            ctx.batch = None
        st._micro_step = 0
        # Hold the last loss, and so its graph (whose saved tensors backward has freed), until
        # the next step's forward: autograd then finds each parameter's gradient accumulator
        # alive and reuses it instead of building it anew (a hand-written loop does the same
        # by keeping `loss` in a variable). ~15k fewer CPU instructions a step on bench/loop.py.
        self._last_graph = loss

    def _micro_step(self, st: TrainState, data: Any, model: Any, k: int) -> tuple[Any, Any]:
        """Forward, loss and backward of one micro-batch of ``k``; returns (output, loss)."""
        reducer = self._reducer
        output, loss_func = self._forward(st, data, model)
        loss, _ = reducer.add(loss_func(output))
        # (loss, meta): average over micro-batches. (loss_sum, tokens, meta): keep
        # the sum; gradients are divided by the total token count afterwards.
        self.precision.backward(loss if (reducer.token_mode or k == 1) else loss / k)
        return output, loss

    def _prepare_gradients(self) -> torch.Tensor | None:
        """Unscale, normalise by tokens, clip. Returns the total norm as a tensor, or None."""
        cfg, reducer = self.config.train, self._reducer
        if self.precision.scaler is not None:  # fp16: gradients come scaled up
            self.precision.unscale(self.optimizer)
        if reducer.token_mode:
            # Over all ranks: DDP averaged the per-rank sums, so divide by tokens / ranks.
            total_tokens = reducer.reduce_tokens_across_ranks(self.device)
            torch._foreach_div_(gradients(self.optimizer), total_tokens / self.state._world_size)
        if cfg.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), cfg.clip_grad_norm, foreach=True
            )
            return full_tensor(norm)  # under fsdp a replicated DTensor: callbacks get a tensor
        return None

    def _optimizer_step(self, loss_dict: dict[str, Any], grad_norm: torch.Tensor | None) -> bool:
        """Apply the update unless a callback or a non-finite value says skip."""
        cfg, st = self.config.train, self.state
        skip = self.control.take_skip()
        if not skip and cfg.skip_nonfinite and self.precision.scaler is None:
            # The one host read per step this option costs. (With fp16 the GradScaler
            # does its own inf check and skips the update itself.)
            sharded = st._world_size > 1 or cfg.parallel == "fsdp"  # DTensor gradients
            skip = self._finite_check.step_nonfinite(
                loss_dict["loss"], grad_norm, self.optimizer, sharded
            )
            st._nonfinite_steps += skip
        if st._world_size > 1:
            skip = bool(agree_flags([int(skip)], self.device)[0])
        if skip:
            st._skipped_steps += 1
            if cfg.max_skipped_steps is not None and st._skipped_steps >= cfg.max_skipped_steps:
                raise FloatingPointError(
                    f"{st._skipped_steps} optimizer steps were skipped (non-finite loss or "
                    f"gradient, or skip requests), reaching train.max_skipped_steps="
                    f"{cfg.max_skipped_steps}; last at step {st._step}"
                )
        else:
            if self._rewinder.lr_factor == 1.0:  # no rewind's lower learning rate in force
                self._apply_update()
            else:
                with self._rewinder.lr_scaled(self.optimizer, st._step):
                    self._apply_update()
            if self.scheduler is not None and not self.precision.skipped_update:
                self.scheduler.step()  # not after an update fp16's scaler skipped (as HF)
        self._zero_grad()
        return skip

    # -- the step boundary: log, evaluate, save, stop ----------------------------
    def _step_boundary(self) -> bool:
        """Act on what is due or requested after a step. Returns True to stop training.

        ``_run_epoch`` calls it only after a step that has something due or waiting.
        """
        stopping = self._act_at_boundary()
        self._next_scheduled = self._next_scheduled_step()
        return stopping

    def _next_scheduled_step(self) -> int:
        """The next step whose boundary has something on the schedule: a log, an
        evaluation, a save, the exit interval. Every step with several ranks (they
        agree on requests at each boundary) or with a time limit to watch.

        Worked out again at every boundary that acts, so an interval a callback changes
        mid-run applies from then on (``log_every`` at once: ``will_log`` is read each step).
        """
        cfg, step = self.config.train, self.state._step
        if self.state._world_size > 1 or cfg.exit_duration_minutes is not None:
            return step + 1
        intervals = [cfg.log_every, cfg.exit_interval]
        if self.eval_loader is not None:
            intervals.append(cfg.eval_every)
        for manager in (self.checkpoints, self.local_checkpoints):
            if manager is not None:
                intervals.append(manager.policy.every)
        return min([(step // n + 1) * n for n in intervals if n], default=sys.maxsize)

    def _act_at_boundary(self) -> bool:
        """The step boundary's work: collect a finished background save, drain requests,
        then log, evaluate, rewind, stop or save. Returns True to stop training."""
        cfg, st = self.config.train, self.state
        if self._saves.busy:  # a background commit that has ended fires on_checkpoint_save now
            self._collect_saves(wait=False)
        requests = self._take_requests()
        if self._aborts(requests):
            return True
        ran_handlers = False
        if requests.log or st._will_log:
            self._log()
            ran_handlers = True
        if self.eval_loader is not None and (
            requests.evaluate or (cfg.eval_every and st._step % cfg.eval_every == 0)
        ):
            self._evaluate_in_training()
            ran_handlers = True
        if ran_handlers:  # a log or eval handler may have asked to stop (e.g. early stopping)
            later = self._take_requests()
            if later is not NO_REQUESTS:
                self._carry_over(later)
                requests = requests.merge(later)
        if self._aborts(requests):
            return True
        if requests.rewind is not None and (requests.failed or not requests.stop):
            return self._rewind(requests.rewind)  # a detector's failed stop yields to it
        stopping = self._requests_stop(requests)
        checkpoints = self.checkpoints
        if not stopping and checkpoints and checkpoints.due(st._step, requested=requests.save):
            self.save_checkpoint()
        elif not stopping and self.local_checkpoints and self.local_checkpoints.due(st._step):
            self._save_local_checkpoint()
        return stopping

    def _epoch_boundary(self) -> None:
        """Act on requests filed during the epoch end (e.g. early stopping on eval)."""
        st = self.state
        requests = self._take_requests()
        self._carry_over(requests)
        if self._aborts(requests):
            return
        if requests.rewind is not None and (requests.failed or not requests.stop):
            self._rewind(requests.rewind)
            return
        if st._stop_reason is None:
            self._requests_stop(requests)
        if requests.save and self.checkpoints is not None:  # also after the last epoch
            self.save_checkpoint()

    def _carry_over(self, requests: Requests) -> None:
        """Keep a log or evaluation asked for where none can run now for the next step."""
        if requests.log:
            self.control.request_log()
        if requests.evaluate:
            self.control.request_evaluate()

    def _take_requests(self) -> Requests:
        """Drain control requests and the signal flag, agreed across ranks."""
        if self._signal is None and self.state._world_size == 1 and not self.control._pending:
            return NO_REQUESTS  # what drain() returns then, without its three calls
        requests = self.control.drain(
            signal=self._signal, world_size=self.state._world_size, device=self.device
        )
        if requests.signal:
            self._signal = requests.signal  # a signal caught on another rank stops this one
        return requests

    def _aborts(self, requests: Requests) -> bool:
        """An abort ends training at once, saving nothing; sets ``stop_reason``."""
        if not requests.abort:
            return False
        self.state._stop_reason = f"abort: {requests.abort}"
        self.state._failed |= requests.failed
        return True

    def _requests_stop(self, requests: Requests) -> bool:
        """Stop conditions other than the step budget; sets ``stop_reason``."""
        cfg, st = self.config.train, self.state
        reason = None
        if requests.stop:
            reason = (
                f"signal {signal.Signals(self._signal).name}" if self._signal else requests.stop
            )
        elif cfg.exit_interval and st._step % cfg.exit_interval == 0:
            reason = "exit_interval"
        elif cfg.exit_duration_minutes is not None and (
            time.monotonic() - self._start_time >= cfg.exit_duration_minutes * 60
        ):
            reason = "exit_duration"
        if reason is None:
            return False
        st._stop_reason = reason
        st._failed |= requests.failed
        return True

    def _check_skipped(self) -> None:
        """A run whose steps were mostly skipped (NaN/Inf) did not train: it failed."""
        limit, st = self.config.train.max_skipped_fraction, self.state
        if limit is None or st._failed or not st._step or st._skipped_steps <= limit * st._step:
            return
        st._failed = True
        st._stop_reason = (
            f"failed: {st._skipped_steps} of {st._step} steps skipped (more than "
            f"train.max_skipped_fraction={limit})"
        )

    def _sync_tokens(self) -> None:
        """Fold device-side token counts into ``state.tokens`` (one host read)."""
        if self._pending_tokens:
            self.state._tokens += int(read_back([sum(self._pending_tokens)])[0][0])
            self._pending_tokens.clear()

    def _log(self) -> None:
        """Build ``ctx.logs`` (this is where values are read back from the device)."""
        st, hooks, window = self.state, self._hooks, self._losses
        keys, values, n = window.stacked()  # every step's losses, or each key's mean
        if values is not None and st._world_size > 1:
            values = all_reduce_mean(values)  # every rank logs the same numbers
        tokens = sum(self._pending_tokens) if self._pending_tokens else None
        self._pending_tokens.clear()
        # One device-to-host transfer for the losses, the grad norm and the token count.
        if window.grad_norm is None and tokens is None and values is not None:
            values_h, norm_h, tokens_h = values.tolist(), None, None  # usual: the losses alone
        else:
            values_h, norm_h, tokens_h = read_back([values, window.grad_norm, tokens])
        if tokens_h is not None:
            st._tokens += int(tokens_h[0])
        logs: dict[str, Any] = {}
        if values_h is not None:
            logs.update(zip(keys, row_means(values_h, n), strict=True))
        if norm_h is not None:
            logs["grad_norm"] = norm_h[0]
        logs["lr"] = float(self.optimizer.param_groups[0]["lr"])
        logs["epoch"] = st._epoch + (
            st._epoch_step / st._steps_per_epoch if st._steps_per_epoch else 0
        )
        logs["skipped_steps"] = st._skipped_steps
        if self._unlogged_saves:  # the saves committed since the last log: count and cost
            saves = self._unlogged_saves
            logs["checkpoint/saves"] = len(saves)
            logs["checkpoint/save_seconds"] = sum(t.seconds for t in saves)
            logs["checkpoint/blocked_seconds"] = sum(t.blocked_seconds for t in saves)
            saves.clear()
        if self._zeros is not None:
            logs["num_zeros_in_grad"] = int(to_float(self._zeros))
            self._zeros = None
        if self.config.train.log_timers:
            logs.update(per_step_ms(st._timers, st._step - self._last_log_step))
        self._last_log_step = st._step
        window.clear()
        if hooks["on_before_log"] or hooks["on_log"]:
            self.ctx.logs = logs
            self._fire("on_before_log")
            self._fire("on_log")
            self.ctx.logs = None
        self._last_logs = logs

    # -- signals ---------------------------------------------------------------
    def _install_signal_handlers(self) -> Any:
        """SIGTERM/SIGINT set a flag; the loop finishes the step, saves and exits.

        A second SIGINT raises KeyboardInterrupt at once, for a user who means it.
        """
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_signal(signum: int, frame: Any) -> None:
            if self._signal == signal.SIGINT and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._signal = signum

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for s, handler in previous.items():
                signal.signal(s, handler)

        return restore


# -- helpers -------------------------------------------------------------------


def _check_flops(value: Any) -> float | None:
    """A FLOPs-per-sample figure must be a finite number > 0 (or None: no estimate)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e300:
        raise ValueError(
            f"flops_per_sample must be a finite number > 0 or None (no estimate), got {value!r}"
        )
    return float(value)


def _batch_count(loader: Iterable[Any] | None, limit: int | None) -> int | None:
    """Batches one pass over ``loader`` runs, when its length is known."""
    try:
        n = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
    return min(n, limit) if limit else n


def _check_arguments(model: Any, optimizer: Any, forward_step: Any, loss_fn: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if forward_step is not None and loss_fn is not None:
        raise ValueError("give forward_step or loss_fn, not both (loss_fn is for the default step)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(outputs, targets), got {loss_fn!r}")


def _as_config(config: Config | TrainConfig | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, TrainConfig):
        return Config(train=config)
    raise TypeError(
        f"config must be a hookloop Config or TrainConfig (or None), got {type(config).__name__}"
    )


def _as_manager(callbacks: Any) -> CallbackManager:
    if callbacks is None:
        return CallbackManager()
    if isinstance(callbacks, CallbackManager):
        return callbacks
    return CallbackManager(callbacks)


def _resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"  # one GPU per process under torchrun
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available; use 'cpu' or 'auto'")
    return device
