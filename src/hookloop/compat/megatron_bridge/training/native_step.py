"""Megatron-Bridge's ``train_step`` on hookloop's own :class:`~hookloop.loop.stepper.Stepper`.

The dialect does not run a backward, a clip or an optimizer update of its own: one
global batch of ``training.train`` goes through the native Stepper, the same one
``hookloop.loop.Trainer`` steps with. The dialect supplies what Megatron-Core does its
own way:

- the data flow (:class:`MegatronMicroStep`, the native micro-step with its own
  forward): ``forward_step(data_iterator, model)`` reads its micro-batch from the
  user's iterator itself (Megatron-Core's schedule hands the forward step the
  iterator, not a batch);
- the losses (:class:`MegatronLosses`): the native micro-step back-propagates
  ``loss / num_tokens`` (or ``loss``) over the micro-batch count, as Megatron-Core
  scales it, and each micro-batch's ``loss_dict`` is kept and reduced as
  Megatron-Bridge's ``train_step`` does (:func:`~.microbatches.reduce_loss_dicts`);
- the skip rule: with ``optimizer.clip_grad`` > 0 an update whose gradient norm is not
  finite is skipped (Megatron's optimizer reports it as an unsuccessful update).

Clipping (to ``optimizer.clip_grad``), ``optimizer.step()``, the scheduler step after a
successful update (by the global batch size for a scheduler with Megatron's
``step(increment)``) and the clearing of the gradients are the Stepper's.
"""

from __future__ import annotations

import collections
import inspect
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.checkpoint.rewind import Rewinder
from hookloop.compat.megatron_bridge.training.megatron_core import chunk_device
from hookloop.compat.megatron_bridge.training.microbatches import (
    microbatches,
    ran_out_of_data,
    reduce_loss_dicts,
    split_loss,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.config import TrainConfig
from hookloop.distributed import rank_info
from hookloop.loop.records import Compute, Events, LoopTiming, Trained
from hookloop.loop.stepper import Clipping, MicroStep, Stepper, UpdateRules
from hookloop.precision import Precision
from hookloop.state import CallbackContext, Progress
from hookloop.step import LossReducer

#: ``(loss_dict, skipped_iter, grad_norm)`` of one step.
StepOutcome = tuple[dict[str, torch.Tensor], int, float | None]


class MegatronLosses(LossReducer):
    """The step's ``loss_dict``s, one per micro-batch, reduced as Megatron-Bridge does.

    The native :class:`~hookloop.loop.stepper.MicroStep` hands it each ``loss_func``
    result and back-propagates what :meth:`add` returns, divided by the micro-batch count.
    """

    __slots__ = ("loss_dicts",)

    def reset(self) -> None:
        super().reset()
        self.token_mode = False  # the loss comes divided by its own tokens (Megatron-Core's)
        self.loss_dicts: list[dict[str, torch.Tensor]] = []

    def add(self, result: Any) -> tuple[torch.Tensor, Any]:
        loss, loss_dict = split_loss(result)
        self.loss_dicts.append(loss_dict)
        return loss, None

    def result(self) -> dict[str, Any]:
        return reduce_loss_dicts(self.loss_dicts)


class MegatronMicroStep(MicroStep):
    """The native micro-step (forward, ``loss_func``, backward of the loss over the
    micro-batch count) with Megatron-Core's data flow: the forward step draws its
    micro-batch from ``data_iterator`` itself (the loop's group only counts them), and
    its losses go to :class:`MegatronLosses`."""

    def __init__(
        self,
        forward: Callable[[Iterator[Any] | None, Any], tuple[Any, Callable[[Any], Any]]],
        data_iterator: Iterator[Any] | None,
        precision: Precision,
        count: int,
    ) -> None:
        super().__init__(self.forward_on_iterator, None, precision)
        self.reducer: MegatronLosses = MegatronLosses()
        self.user_forward, self.data_iterator, self.count = forward, data_iterator, count

    def forward_on_iterator(self, state: Any, group: Iterator[Any], model: Any) -> Any:
        """``forward_step(data_iterator, model)`` on the user's iterator, its end named."""
        try:
            return self.user_forward(self.data_iterator, model)
        except StopIteration:
            index = len(self.reducer.loss_dicts)
            raise ran_out_of_data("train_data_iterator", index, self.count) from None


class SteppedByIncrement:
    """A scheduler with Megatron's ``step(increment)`` (the samples the update consumed,
    as Megatron-Bridge's ``OptimizerParamScheduler`` counts them), as the Stepper steps it."""

    def __init__(self, scheduler: Any, increment: int) -> None:
        self.scheduler, self.increment = scheduler, increment

    def step(self) -> None:
        self.scheduler.step(increment=self.increment)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's own state (none when it keeps none), for a checkpoint."""
        save = getattr(self.scheduler, "state_dict", None)
        return save() if save is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load = getattr(self.scheduler, "load_state_dict", None)
        if load is not None:
            load(state)


def stepped_scheduler(scheduler: Any, increment: int) -> Any:
    """``scheduler`` as the Stepper steps it: by ``increment`` when its ``step`` takes one
    (Megatron's), else as it is (a torch LR scheduler, or None)."""
    step = getattr(scheduler, "step", None)
    try:
        takes_increment = step is not None and "increment" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # a builtin without a signature: torch's own kind
        takes_increment = False
    return SteppedByIncrement(scheduler, increment) if takes_increment else scheduler


def users_scheduler(scheduler: Any) -> Any:
    """The scheduler the user gave, which callbacks see (not the Stepper's view of it)."""
    return scheduler.scheduler if isinstance(scheduler, SteppedByIncrement) else scheduler


def megatron_stepper(
    forward: Callable[..., Any],
    data_iterator: Iterator[Any] | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    global_state: GlobalState,
) -> Stepper:
    """A native Stepper over one model chunk, timed by the run's ``forward-backward`` and
    ``optimizer`` timers, clipping to ``optimizer.clip_grad`` (0: no clipping, no norm)."""
    device = chunk_device([model])
    precision = Precision("fp32", device)  # the loop's tensors are the model's own dtype
    progress = Progress()
    progress.place(*rank_info())
    timers = global_state.timers
    clip = global_state.cfg.optimizer.clip_grad
    micro_step = MegatronMicroStep(forward, data_iterator, precision, microbatches(global_state))
    scheduler = stepped_scheduler(scheduler, global_state.cfg.train.global_batch_size)
    return Stepper(
        trained=Trained(model, model, optimizer, scheduler),
        compute=Compute(micro_step.forward, None, precision, device),
        micro_step=micro_step,
        # The skip rule is Megatron's (run_step), not the native loss-and-gradient check.
        rules=UpdateRules(
            Clipping(clip if clip > 0 else None),
            TrainConfig(skip_nonfinite=False, max_skipped_steps=None),
        ),
        # Megatron-Bridge has no micro-step events: the Stepper fires none.
        events=Events(CallbackContext(), collections.defaultdict(tuple), _no_event),
        progress=progress,
        rewinder=Rewinder(progress, 1),
        timing=LoopTiming(
            time.perf_counter,
            {name: timers(name) for name in ("forward-backward", "optimizer")},
        ),
    )


def run_step(stepper: Stepper) -> StepOutcome:
    """One global batch through ``stepper`` (a :func:`megatron_stepper`): the step's
    losses, 1 when the update was skipped (else 0), and the gradient norm as a float
    (None: not clipped, or not finite)."""
    micro_step = stepper.micro_step
    assert isinstance(micro_step, MegatronMicroStep)
    stepper.forward_backward([None] * micro_step.count)
    loss_dict, norm = stepper.prepare()
    grad_norm = None if norm is None else float(norm)  # Megatron-Bridge returns a float
    if grad_norm is not None and not math.isfinite(grad_norm):
        stepper.control.skip_step()
        grad_norm = None
    skipped = stepper.update(loss_dict, norm)
    return loss_dict, int(skipped), grad_norm


def _no_event(event: str, ctx: CallbackContext) -> None:
    """Megatron-Bridge has no micro-step events: the Stepper fires none."""
