"""One optimizer step's mechanics: micro-steps, gradients, the update.

The loop (:mod:`hookloop.loop.trainer`) says *when*; the :class:`Stepper` does *how*:

1. :meth:`Stepper.forward_backward`: for each of the step's micro-batches, forward,
   loss and backward (a :class:`MicroStep`: the user's forward step and its loss
   reduction, or a dialect's own), firing ``on_micro_step_start`` / ``_end``.
   Gradients are reduced across ranks only on the last micro-batch.
2. :meth:`Stepper.prepare`: unscale (fp16), divide by the step's tokens (the
   ``(loss_sum, num_tokens, meta)`` pattern), clip; the grad norm stays a tensor.
3. :meth:`Stepper.update`: skip the update (a request, or a NaN/Inf loss or
   gradient with ``train.skip_nonfinite``), or call ``optimizer.step()`` and the
   LR scheduler; then clear the gradients.

The optimizer is called through its public API only: ``optimizer.step()`` (or the
GradScaler's step under fp16) and, for clearing, every parameter's ``.grad = None``,
which is what ``optimizer.zero_grad(set_to_none=True)`` does (an optimizer with a
``zero_grad`` of its own gets it called).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hookloop.config import TrainConfig
from hookloop.distributed import agree_flags, full_tensor, local_shards, no_gradient_sync
from hookloop.loop.device_skip import DeviceSkip, finiteness_probe, fused_optimizer
from hookloop.loop.records import Compute, Events, LoopTiming, Trained
from hookloop.precision import Precision
from hookloop.state import Progress
from hookloop.step import LossReducer, count_zeros

_NULL_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


class MicroStep:
    """Forward, loss and backward of one micro-batch: the user's forward step
    (``forward_step(state, data_iterator, model) -> (output, loss_func)``) and the
    reduction of what ``loss_func`` returns (:class:`~hookloop.step.LossReducer`).

    A dialect replaces it to compute the loss its own way (transformers' Trainer:
    ``compute_loss`` scaled by the items in the batch); the micro-step loop around it
    (:meth:`Stepper.forward_backward`) stays the one in the codebase.
    """

    def __init__(self, forward: Callable[..., Any], state: Any, precision: Precision) -> None:
        self.forward = forward
        self.state = state  # what the forward step receives first (the read-only TrainState)
        self.precision = precision
        self.reducer = LossReducer()

    def begin(self, group: list[Any]) -> None:
        """A new step over the micro-batches of ``group``."""
        self.reducer.reset()

    def run(self, batch: Any, data: Iterator[Any], model: Any, k: int) -> tuple[Any, Any]:
        """One micro-batch of ``k``: the forward step takes it from ``data`` (``batch`` is
        that same micro-batch). Returns ``(output, loss)`` for the micro-step events."""
        reducer = self.reducer
        output, loss_func = self.forward(self.state, data, model)
        loss, _ = reducer.add(loss_func(output))
        # (loss, meta): average over micro-batches. (loss_sum, tokens, meta): keep
        # the sum; gradients are divided by the total token count afterwards.
        self.precision.backward(loss if (reducer.token_mode or k == 1) else loss / k)
        return output, loss

    def end(self) -> None:
        """After the step's last micro-batch (a dialect may add up its losses here)."""


class Clipping:
    """How the step treats the gradient norm: clip to ``max_norm`` (None: neither clip
    nor measure, unless ``always_measure``: then measure without clipping), with
    ``clip_grad_norm_``'s ``foreach`` as given (transformers' Trainer leaves it to torch)."""

    def __init__(
        self, max_norm: float | None, *, always_measure: bool = False, foreach: bool | None = True
    ) -> None:
        #: What ``max_norm`` becomes when clipping is turned off mid-run (a live ``set``).
        self.off_value = math.inf if always_measure else None
        self.max_norm = max_norm if max_norm else self.off_value
        self.foreach = foreach


@dataclass(frozen=True)
class UpdateRules:
    """How the step treats its gradients and when it leaves the update out: the
    :class:`Clipping` (the config's ``clip_grad_norm``, or a dialect's), and ``train``'s
    skip rule (``skip_nonfinite``, ``max_skipped_steps``), zero count
    (``log_num_zeros_in_grad``) and ``parallel``, read as they stand at each step."""

    clipping: Clipping
    train: TrainConfig


class Stepper:
    """Runs one optimizer step over a group of micro-batches (see the module doc).

    ``tokens`` (the step's token count, pattern 2) and ``zeros`` (zero gradient
    elements, counted on a log step when ``train.log_num_zeros_in_grad``) are left for the log
    book as device tensors; ``lr_used`` is the learning rate the last update applied
    (read before the scheduler stepped). A scheduler whose ``step`` takes a metric
    (:func:`steps_on_a_metric`) is stepped by whoever has the metric, not here.
    """

    def __init__(
        self,
        *,
        trained: Trained,
        compute: Compute,
        micro_step: MicroStep,
        rules: UpdateRules,
        events: Events,
        progress: Progress,
        rewinder: Any,
        timing: LoopTiming,
    ) -> None:
        self.model, self.train_model = trained.model, trained.train_model
        self.optimizer, self.scheduler = trained.optimizer, trained.scheduler
        self.precision, self.device = compute.precision, compute.device
        self.micro_step, self.clipping, self.config = micro_step, rules.clipping, rules.train
        self.ctx, self.hooks, self.fire = events.ctx, events.hooks, events.fire
        self.control = events.control
        self.progress, self.rewinder = progress, rewinder
        self.fb_timer = timing.timers["forward-backward"]
        self.opt_timer = timing.timers["optimizer"]
        self.clock = timing.clock
        # False: a metric-driven scheduler (ReduceLROnPlateau), stepped after evaluations.
        self.steps_scheduler = not steps_on_a_metric(self.scheduler)
        self.finite = FiniteCheck(self.device)
        self.device_skip: DeviceSkip | None = None  # set by bind() for a fused optimizer
        self.skip_flag: torch.Tensor | None = None  # the device's verdict of the last step
        self.tokens: torch.Tensor | None = None
        self.zeros: torch.Tensor | None = None
        self.lr_used: Any = None
        self._prepare_time = 0.0
        self._last_graph: torch.Tensor | None = None
        self.bind()

    def bind(self) -> None:
        """The update and the clearing for ``self.optimizer`` (again at each train())."""
        self._clear = gradient_clearer(self.optimizer)
        # A fused optimizer over gradients every rank holds alike: the verdict on the device.
        alike = self.progress.world_size == 1 or self.config.parallel == "ddp"
        fused = fused_optimizer(self.optimizer) and alike
        self.device_skip = DeviceSkip(self.device, self.finite.on_cpu) if fused else None
        # optimizer.step(), looked up at each call (a scheduler or a profiler may wrap it on
        # the instance); fp16: the GradScaler calls it, or skips it.
        self._apply_update = functools.partial(self.precision.step, self.optimizer)

    def release(self) -> None:
        """Drop the last step's loss (a finished run holds no autograd graph)."""
        self._last_graph = None

    # -- 1. micro-steps ------------------------------------------------------
    def forward_backward(self, group: list[Any]) -> None:
        """Forward, loss and backward for each micro-batch, firing the micro-step events."""
        started = self.clock()
        st, hooks, ctx, fire = self.progress, self.hooks, self.ctx, self.fire
        k, model, precision, micro = len(group), self.train_model, self.precision, self.micro_step
        micro.begin(group)
        data = iter(group)
        loss = None
        for i, batch in enumerate(group):
            st.at_micro_step(i)
            if hooks["on_micro_step_start"]:
                ctx.batch = batch
                fire("on_micro_step_start", ctx)
            # Gradients are reduced across ranks only on the last micro-batch of the step.
            last = i == k - 1
            if last and precision.dtype is None:  # fp32, no sync to hold: no context to enter
                output, loss = micro.run(batch, data, model, k)
            else:
                with precision.autocast(), _NULL_CONTEXT if last else no_gradient_sync(model):
                    output, loss = micro.run(batch, data, model, k)
            if hooks["on_micro_step_end"]:
                ctx.batch, ctx.outputs, ctx.loss = batch, output, loss.detach()
                fire("on_micro_step_end", ctx)
                ctx.outputs = ctx.loss = None
            ctx.batch = None
        st.at_micro_step(0)
        micro.end()
        # Hold the last loss, and so its graph (whose saved tensors backward has freed), until
        # the next step's forward: autograd then finds each parameter's gradient accumulator
        # alive and reuses it instead of building it anew (a hand-written loop does the same
        # by keeping `loss` in a variable). ~15k fewer CPU instructions a step on bench/loop.py.
        self._last_graph = loss
        self.fb_timer.add(self.clock() - started)

    # -- 2. gradients --------------------------------------------------------
    def prepare(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Unscale, normalise by tokens, clip; count zeros on a log step. Returns the
        step's reduced losses and the total grad norm (tensors; None: not measured)."""
        started = self.clock()
        reducer, precision, optimizer = self.micro_step.reducer, self.precision, self.optimizer
        if precision.scaler is not None:  # fp16: gradients come scaled up
            precision.unscale(optimizer)
        self.tokens = None
        if reducer.token_mode:
            # Over all ranks: DDP averaged the per-rank sums, so divide by tokens / ranks.
            self.tokens = total = reducer.reduce_tokens_across_ranks(self.device)
            scale = total / self.progress.world_size
            for grad in gradients(optimizer):
                grad.div_(scale)
        grad_norm = None
        clipping = self.clipping
        if clipping.max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), clipping.max_norm, foreach=clipping.foreach
            )
            grad_norm = full_tensor(norm)  # under fsdp a replicated DTensor: callbacks get a tensor
        if self.progress.will_log and self.config.log_num_zeros_in_grad:
            sharded = self.config.parallel == "fsdp" and self.progress.world_size > 1
            self.zeros = count_zeros(gradients(optimizer), sharded=sharded)
        self._prepare_time = self.clock() - started
        return reducer.result(), grad_norm

    # -- 3. the update --------------------------------------------------------
    def update(self, loss_dict: dict[str, Any], grad_norm: torch.Tensor | None) -> bool:
        """Apply the update unless a callback or a non-finite value says skip; step the
        scheduler; clear the gradients. Returns whether the update was skipped."""
        started = self.clock()
        cfg, st, precision = self.config, self.progress, self.precision
        self.lr_used = self.optimizer.param_groups[0]["lr"]
        control = self.control
        skip = control.skip_requested
        if skip:
            control.skip_requested = False
        shared = self._gradients_shared(grad_norm)
        self.skip_flag = None
        checks = not skip and cfg.skip_nonfinite and precision.scaler is None
        on_device = self.device_skip if checks else None
        if on_device is not None:
            # A fused optimizer skips a non-finite update itself: no host read.
            self.skip_flag = on_device.update(
                self.optimizer,
                grad_norm,
                [] if grad_norm is not None else gradients(self.optimizer),
                self._around,
            )
        elif checks:
            # One host read. (With fp16 the GradScaler does its own inf check and skips
            # the update itself.) With gradients every rank holds alike, the verdict is the
            # same on every rank without a collective; a rank's own loss is left out then
            # (a non-finite loss makes the all-reduced gradients non-finite everywhere).
            sharded = st.world_size > 1 or cfg.parallel == "fsdp"  # DTensor gradients
            loss = None if shared and st.world_size > 1 else loss_dict["loss"]
            skip = self.finite.step_nonfinite(loss, grad_norm, self.optimizer, sharded=sharded)
            if skip:
                st.count_nonfinite()
        if st.world_size > 1 and not shared:
            # Per-rank gradients (train.parallel=local, fsdp without a total norm): the one
            # case that agrees before the update, in a collective of its own.
            skip = bool(agree_flags([int(skip)], self.device)[0])
        if skip:
            self._skipped()
        elif self.skip_flag is None:
            self._around(self._apply_update)
        stepped = not skip and not precision.skipped_update  # fp16's scaler may skip (as HF)
        if stepped and self.steps_scheduler and self.scheduler is not None:
            self.scheduler.step()
        self._clear()
        # Two intervals, as the optimizer timer has always counted them.
        self.opt_timer.add(self._prepare_time + (self.clock() - started), intervals=2)
        return skip

    def _around(self, apply: Callable[[], Any]) -> None:
        """Run the update ``apply``, inside a rewind's lowered learning rate while one holds."""
        if self.rewinder.lr_factor == 1.0:  # no rewind's lower learning rate in force
            apply()
        else:
            with self.rewinder.lr_scaled(self.optimizer, self.progress.step):
                apply()

    def settle(self) -> None:
        """Count the updates the device skipped since the host last looked (a log, a save,
        an evaluation, a stop or the end of training; one read)."""
        if self.device_skip is not None:
            self.device_skip.settle(self.progress, self.config.max_skipped_steps)

    def _gradients_shared(self, grad_norm: torch.Tensor | None) -> bool:
        """Whether every rank holds the same gradients (DDP's all-reduce) or the same total
        norm over them (FSDP's clipping): then a verdict drawn from them is every rank's."""
        parallel = self.config.parallel
        return parallel == "ddp" or (parallel == "fsdp" and grad_norm is not None)

    def _skipped(self) -> None:
        st, limit = self.progress, self.config.max_skipped_steps
        st.count_skipped()
        if limit is not None and st.skipped_steps >= limit:
            raise FloatingPointError(
                f"{st.skipped_steps} optimizer steps were skipped (non-finite loss or "
                f"gradient, or skip requests), reaching train.max_skipped_steps={limit}; "
                f"last at step {st.step}"
            )


def steps_on_a_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` takes a metric (``ReduceLROnPlateau``, transformers'
    ``GreedyLR``): stepped after evaluations, not once a step."""
    if scheduler is None:
        return False
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        params = list(inspect.signature(scheduler.step).parameters.values())
    except (TypeError, ValueError):
        return False
    first = params[0] if params else None
    return first is not None and first.name == "metrics" and first.default is first.empty


def gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter's ``.grad`` the optimizer will use (parameters without one left out)."""
    if len(optimizer.param_groups) == 1:
        return [p.grad for p in optimizer.param_groups[0]["params"] if p.grad is not None]
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def gradient_clearer(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """What the loop calls after each update: ``optimizer.zero_grad(set_to_none=True)``'s
    effect. For an optimizer that keeps torch's ``zero_grad``, every parameter of every
    group gets ``.grad = None`` directly (torch's method also opens a profiler range on
    every call, which costs more than the clearing); an optimizer with a ``zero_grad`` of
    its own (a subclass's, or one set on the instance) always gets it called."""
    own = type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad
    if own or "zero_grad" in vars(optimizer):
        return lambda: optimizer.zero_grad(set_to_none=True)

    def clear() -> None:
        for group in optimizer.param_groups:  # read each time: load_state_dict replaces it
            for p in group["params"]:
                p.grad = None

    return clear


class FiniteCheck:
    """Is any element of these tensors NaN or Inf? One host read of one scalar, however
    many tensors (:func:`~hookloop.loop.device_skip.finiteness_probe` says how)."""

    def __init__(self, device: torch.device) -> None:
        self.on_cpu = device.type == "cpu"

    def step_nonfinite(
        self,
        loss: torch.Tensor | None,
        grad_norm: torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
        *,
        sharded: bool,
    ) -> bool:
        """Whether a step's (detached) loss or any gradient the optimizer will use is NaN or
        Inf. Its ``grad_norm``, when there is one, stands for the gradients: a norm over
        them is non-finite when one of them is. ``loss=None``: the gradients alone."""
        tensors = [grad_norm] if grad_norm is not None else gradients(optimizer)
        return self.any_nonfinite(tensors if loss is None else [loss, *tensors], sharded=sharded)

    def any_nonfinite(self, tensors: list[torch.Tensor], *, sharded: bool = True) -> bool:
        """``tensors`` must not require grad (detached losses, ``p.grad``). Sharded
        gradients are checked on this rank's slice; the caller agrees the answer across
        ranks. ``sharded=False`` (one process: no DTensor) skips the look for slices."""
        if sharded:
            tensors = local_shards(tensors)
        tensors = [t for t in tensors if t.numel()]  # a rank may hold an empty slice
        if not tensors:
            return False
        return not math.isfinite(finiteness_probe(tensors, self.on_cpu).item())
