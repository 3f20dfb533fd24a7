"""The parts transformers' Trainer decides differently, for hookloop's one loop.

When ``TrainingArguments`` decide a dialect run, :func:`dialect` hands the loop
(:class:`hookloop.Trainer`) these in place of the native parts:

- :class:`~hookloop.compat.hf.schedule.HFFlow`: HF's flow, decided from the
  flags ``DefaultFlowCallback`` sets (:mod:`hookloop.compat.hf.schedule`).
- :func:`plan_budget`: an epoch is ``ceil(batches / gradient_accumulation_steps)``
  steps; ``num_train_epochs`` may be fractional; ``epoch`` counts micro-batches.
- :class:`HFMicroStep`: ``compute_loss`` with ``num_items_in_batch`` and HF's
  accumulation scaling (:mod:`hookloop.compat.hf.loss`).
- :class:`HFLogBook`: a log with HF's keys (``loss``, ``grad_norm``,
  ``learning_rate``, ``epoch``); ``learning_rate`` is the rate the step used.
- :class:`~hookloop.compat.hf.evaluation_loop.HFEvaluation`: ``evaluation_loop``'s
  loss per sample and ``compute_metrics(EvalPrediction)``
  (:mod:`hookloop.compat.hf.evaluation_loop`).
- checkpoints saved only when a flag asks (a signal still saves), kept by
  ``save_total_limit`` as HF keeps them (:class:`~hookloop.compat.hf.layout.HFRetention`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hookloop.checkpoint.manager import CheckpointManager
from hookloop.compat.hf import console, flow, layout
from hookloop.compat.hf import optim as hf_optim
from hookloop.compat.hf.evaluation_loop import HFEvaluation
from hookloop.compat.hf.loss import HFLoss
from hookloop.compat.hf.schedule import flow_of
from hookloop.config import CheckpointConfig, TrainConfig
from hookloop.loop.evaluation import Evaluation
from hookloop.loop.live import LiveSettings, Setting, SettingError
from hookloop.loop.logbook import LogBook
from hookloop.loop.parts import Dialect, native_evaluation
from hookloop.loop.parts import plan_budget as native_budget
from hookloop.loop.records import Compute, Events, Trained
from hookloop.loop.stepper import Clipping, MicroStep, Stepper
from hookloop.state import Progress
from hookloop.step import move_to, to_float


def dialect(session: Any, hf_loss: HFLoss | None, compute_metrics: Any) -> Dialect:
    """The parts of a run that ``TrainingArguments`` decide. ``hf_loss`` is None when
    the loss is the user's own (a ``loss_fn`` or a ``forward_step``): the native
    micro-step and evaluation then run."""
    return Dialect(
        plan_budget=functools.partial(plan_budget, session=session),
        micro_step=functools.partial(_micro_step, hf_loss=hf_loss, session=session),
        clipping=functools.partial(_clipping, session=session),
        logbook=functools.partial(_logbook, session=session),
        evaluation=functools.partial(
            _evaluation, session=session, hf_loss=hf_loss, compute_metrics=compute_metrics
        ),
        checkpoints=functools.partial(_checkpoints, session=session),
        flow=functools.partial(flow_of, session=session),
        live=functools.partial(_live, session=session),
        announce_repeated_saves=True,  # a step save and an epoch save: on_save fires twice
        steps_metric_scheduler=True,  # ReduceLROnPlateau after evaluations, as HF
        fetch_ahead=True,  # the next batch is collated before this one trains, as HF
        rng_after_first_fetch=True,  # a resume's generators restored as transformers does
    )


# -- the budget ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """HF's ``set_initial_training_values``: micro-batches and steps per epoch (a partial
    last group counts), the step budget and the epochs it spans."""

    batches: int
    steps_per_epoch: int
    max_steps: int
    num_epochs: int | None


def plan_of(args: Any, loader: Any, grad_accum: int) -> Plan:
    """The plan for ``args`` over ``loader`` (a stream: ``max_steps`` decides)."""
    max_steps = hf_optim.arg(args, "max_steps", -1)
    try:
        batches = len(loader)
    except TypeError:  # a stream has no length: the budget is max_steps
        if max_steps <= 0:
            raise ValueError(
                "the train data has no length (a stream), so TrainingArguments.max_steps must "
                f"be > 0 to say how long to train; got max_steps={max_steps}"
            ) from None
        return Plan(0, max_steps, max_steps, None)
    if batches == 0:
        raise ValueError("the train data has no batch (fewer samples than a batch, with drop_last)")
    per_epoch = max(math.ceil(batches / grad_accum), 1)
    if max_steps > 0:
        return Plan(batches, per_epoch, max_steps, None)
    epochs = float(hf_optim.arg(args, "num_train_epochs", 3.0))
    return Plan(batches, per_epoch, math.ceil(epochs * per_epoch), math.ceil(epochs))


def plan_budget(train: Any, config: TrainConfig, progress: Progress, *, session: Any) -> None:
    """HF's budget on the loop's counters; HF's ``epoch`` then counts micro-batches."""
    k = config.grad_accum
    if train is None:
        native_budget(train, config, progress)
        return
    plan = plan_of(session.args, train, k)
    if not plan.batches:  # a stream: max_steps decides (checked there)
        native_budget(train, config, progress)
        return
    progress.plan(
        plan.steps_per_epoch,
        plan.num_epochs,
        plan.max_steps,
    )
    session.state.count_epochs_in_batches(plan.batches, k)
    session.train_samples = samples_of(session.args, train, plan, k * progress.world_size)


def samples_of(args: Any, loader: Any, plan: Plan, groups: int) -> float:
    """HF's ``num_train_samples``: ``max_steps`` x the total batch when ``max_steps`` is
    set, else the dataset's length x ``num_train_epochs``."""
    per_device = hf_optim.arg(args, "per_device_train_batch_size", 8)
    if hf_optim.arg(args, "max_steps", -1) > 0:
        return plan.max_steps * per_device * groups
    dataset = getattr(loader, "dataset", None)
    try:
        examples = len(dataset)  # type: ignore[arg-type]  # no length: TypeError below
    except TypeError:
        examples = len(loader) * per_device
    return examples * hf_optim.arg(args, "num_train_epochs", 3.0)


# -- the micro-step and the gradients ------------------------------------------------------


class HFMicroStep(MicroStep):
    """``training_step`` for each micro-batch of dict batches (``compute_loss`` and its
    accumulation scaling); the step's loss is the sum of the scaled losses. Batches of
    another shape run the native micro-step.

    With ``logging_nan_inf_filter`` (HF's default) a NaN or Inf micro-batch loss counts,
    in the logged loss, as the mean of the window so far, as HF's loop adds it; the
    update itself is applied, as HF applies it. (On the device: no host read.)
    """

    def __init__(
        self,
        forward: Any,
        state: Any,
        precision: Any,
        *,
        hf_loss: HFLoss,
        device: Any,
        progress: Any,
        session: Any,
    ) -> None:
        super().__init__(forward, state, precision)
        self.hf_loss, self.device, self.progress = hf_loss, device, progress
        self.session = session
        self.nan_filter = bool(hf_optim.arg(session.args, "logging_nan_inf_filter", True))
        self.window_total: torch.Tensor | None = None  # the losses logged since the last log
        self.window_of: int | None = None  # the step that log was at
        self.native = True
        self.num_items: Any = None
        self.step_loss: torch.Tensor | None = None

    def begin(self, group: list[Any]) -> None:
        super().begin(group)
        self.native = not isinstance(group[0], Mapping)
        if not self.native:
            self.num_items = self.hf_loss.items_in_batch(group)
            self.step_loss = None

    def run(self, batch: Any, data: Iterator[Any], model: Any, k: int) -> tuple[Any, Any]:
        if self.native:
            return super().run(batch, data, model, k)
        hf_loss = self.hf_loss
        inputs = move_to(batch, self.device)
        if hf_loss.floating_point_ops is not None:  # total_flos, as HF counts it
            self.progress.add_flops(float(hf_loss.floating_point_ops(inputs)))
        if self.session.tokens is not None:  # include_num_input_tokens_seen
            self.session.tokens.count(inputs)
        hf_loss.group_size = k
        if hf_loss.training_step is not None:  # a subclass's training_step: it backpropagates
            outputs, part = None, hf_loss.training_step(model, inputs, self.num_items)
            loss = part
        else:
            loss, outputs = hf_loss(model, inputs, self.num_items)
            scaled = hf_loss.scaled(loss, self.num_items, k)
            self.precision.backward(scaled)
            part = scaled.detach()
        if self.nan_filter:
            part = self.filtered(part)
        self.step_loss = part if self.step_loss is None else self.step_loss + part
        return outputs, loss

    def filtered(self, part: torch.Tensor) -> torch.Tensor:
        """``part``, or where it is NaN/Inf the mean of the window so far (HF's rule)."""
        logged_at = self.session.last_logged_step
        if self.window_of != logged_at:  # a log emptied the window
            self.window_total, self.window_of = None, logged_at
        total = part.new_zeros(()) if self.window_total is None else self.window_total
        if self.step_loss is not None:
            total = total + self.step_loss
        steps_done = self.progress.step - 1 - logged_at  # HF's global_step - last logged
        return torch.where(torch.isfinite(part), part, total / (1 + steps_done))

    def end(self) -> None:
        if not self.native and self.session.tokens is not None:
            self.session.tokens.end_step()
        if not self.native:
            if self.nan_filter and self.step_loss is not None:
                kept = self.window_total
                self.window_total = self.step_loss if kept is None else kept + self.step_loss
            self.reducer.add((self.step_loss, {}))


def _micro_step(
    compute: Compute, progress: Progress, *, hf_loss: HFLoss | None, session: Any
) -> MicroStep:
    if hf_loss is None:
        return MicroStep(compute.forward, compute.state, compute.precision)
    return HFMicroStep(
        compute.forward,
        compute.state,
        compute.precision,
        hf_loss=hf_loss,
        device=compute.device,
        progress=progress,
        session=session,
    )


def _clipping(*, session: Any) -> Clipping:
    """HF clips to ``max_grad_norm`` and always measures the norm (unclipped when 0),
    leaving ``foreach`` to torch."""
    limit = hf_optim.arg(session.args, "max_grad_norm", 1.0)
    return Clipping(limit if limit and limit > 0 else None, always_measure=True, foreach=None)


# -- live settings ------------------------------------------------------------------------


#: Live keys -> the TrainingArguments fields (and TrainerState fields) that hold them in HF.
_INTERVALS = {
    "log_every": ("logging_steps", "logging_strategy"),
    "eval_every": ("eval_steps", "eval_strategy"),
    "save_every": ("save_steps", "save_strategy"),
}
_ARGUMENTS = {"lr": "learning_rate", "weight_decay": "weight_decay", "eps": "adam_epsilon"}


def _live(live: LiveSettings, *, session: Any) -> LiveSettings:
    """Live settings as transformers' Trainer keeps them: the cadences are the
    ``*_steps`` of TrainingArguments and TrainerState (with a ``"steps"`` strategy), and
    ``trainer.args`` follows every optimizer change."""
    args, state = session.args, session.state
    if args is None:
        return live
    for key, (field, strategy_field) in _INTERVALS.items():

        def check(name: str, value: Any, strategy_field: str = strategy_field) -> int:
            strategy = flow.strategy(args, strategy_field)
            if strategy != "steps":
                raise SettingError(
                    f"{name}: {strategy_field} is {strategy!r}, so its steps are not used "
                    "(set it to 'steps' when you build the Trainer)"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SettingError(f"{name} must be an int >= 1, got {value!r}")
            return value

        def put(value: int, field: str = field) -> None:
            setattr(args, field, value)
            setattr(state, field, value)

        read = functools.partial(getattr, state, field)
        live.define(key, Setting(f"TrainingArguments.{field}", read, put, check))
    for key, field in _ARGUMENTS.items():
        live.mirror(key, lambda value, field=field: _set_argument(args, field, value))
    live.mirror("betas", lambda value: _set_betas(args, value))
    live.mirror("clip_grad_norm", lambda value: _set_argument(args, "max_grad_norm", value or 0.0))
    return live


def _set_argument(args: Any, field: str, value: Any) -> None:
    if not isinstance(value, list) and hasattr(args, field):  # groups that differ: no one value
        setattr(args, field, value)


def _set_betas(args: Any, value: Any) -> None:
    if isinstance(value, list) and len(value) == 2 and not isinstance(value[0], list):
        _set_argument(args, "adam_beta1", value[0])
        _set_argument(args, "adam_beta2", value[1])


# -- the log --------------------------------------------------------------------------------


class HFLogBook(LogBook):
    """A log with HF's keys: the mean loss since the last log, ``grad_norm``,
    ``learning_rate`` (the rate the last step used) and ``epoch``; and, at the end, HF's
    summary log (kept as ``session.summary``)."""

    def __init__(
        self,
        *,
        session: Any,
        rate: Any,
        progress: Progress,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig,
        device: torch.device,
        events: Events,
    ) -> None:
        super().__init__(
            progress=progress, optimizer=optimizer, config=config, device=device, events=events
        )
        self.session = session
        self.rate = rate  # () -> the learning rate the last update used (None before one)
        #: A subclass's ``Trainer.log(logs)``: each log goes through it (its ``super().log``
        #: publishes it), as transformers logs (None: published here).
        self.log_hook: Any = None
        self.window_started: float | None = None  # the train() the window's losses are of

    def add_step(
        self,
        loss_dict: dict[str, Any],
        grad_norm: torch.Tensor | None,
        skipped: bool | torch.Tensor,
        tokens: torch.Tensor | None,
        zeros: torch.Tensor | None,
    ) -> None:
        """As transformers' running loss, the window starts empty at each ``train()``: a
        resumed run logs the mean of the steps it ran, not of those before the
        checkpoint too (which the native loop restores)."""
        if self.window_started != self.session.train_start:
            self.window.clear()
            self.window_started = self.session.train_start
        super().add_step(loss_dict, grad_norm, skipped, tokens, zeros)

    def emit(self, logs: dict[str, Any]) -> None:
        if self.log_hook is not None:
            self.log_hook(logs)
        else:
            self.publish(logs)

    def log(self) -> None:
        st, window, session = self.progress, self.window, self.session
        self.sync_tokens()
        steps = st.step - session.last_logged_step
        keys, means = window.means()
        logs: dict[str, Any] = {}
        if means is not None:
            loss = dict(zip(keys, means.tolist(), strict=True)).get("loss", 0.0)
            if session.loss_poisoned:
                loss = math.nan
            # HF resets its running loss by subtracting it from itself: once a logged loss
            # is NaN or Inf, every later one in this train() is NaN, as transformers logs.
            session.loss_poisoned = not math.isfinite(loss)
            logs["loss"] = loss
            session.total_loss += loss * steps
        if window.grad_norm is not None:
            logs["grad_norm"] = to_float(window.grad_norm)
        used = self.rate()  # HF logs the rate the last step used (read before its scheduler step)
        if used is None:
            used = self.optimizer.param_groups[0]["lr"]
        logs["learning_rate"] = float(used)
        logs["epoch"] = session.state.epoch
        if session.tokens is not None:
            session.tokens.add_to_log(logs, started=session.train_start)
        window.clear()
        session.last_logged_step = st.step
        self.emit(logs)

    def summary(self) -> None:
        """HF's end of training, before ``on_train_end``: the summary log."""
        st, session, window = self.progress, self.session, self.window
        console.announce_training_completed()
        self.sync_tokens()
        keys, means = window.means()
        if means is not None:
            loss = dict(zip(keys, means.tolist(), strict=True)).get("loss", 0.0)
            session.total_loss += loss * (st.step - session.last_logged_step)
        steps = st.step - session.first_step
        if session.train_samples is not None:  # HF's count: the plan's share run this time
            samples = session.train_samples * steps / max(st.max_steps or 1, 1)
        else:
            samples = st.samples - session.first_samples
        summary = flow.train_summary(
            time.monotonic() - session.train_start,
            samples=samples,
            steps=steps,
            total_flos=float(st.flops),
            train_loss=session.total_loss / max(steps, 0.001),
        )
        session.refresh(self.ctx, "on_log")
        summary["epoch"] = session.state.epoch
        if session.tokens is not None:
            session.tokens.add_to_log(summary)
        if session.before_summary is not None:  # the memory metrics, when asked for
            session.before_summary(summary)
        session.summary = summary
        self.emit(summary)


def _logbook(
    stepper: Stepper, events: Events, progress: Progress, config: TrainConfig, *, session: Any
) -> LogBook:
    return HFLogBook(
        session=session,
        rate=lambda: stepper.lr_used,
        progress=progress,
        optimizer=stepper.optimizer,
        config=config,
        device=stepper.device,
        events=events,
    )


# -- evaluation -----------------------------------------------------------------------------


def _evaluation(
    trained: Trained,
    compute: Compute,
    events: Events,
    progress: Progress,
    max_batches: int | None,
    *,
    session: Any,
    hf_loss: HFLoss | None,
    compute_metrics: Any,
) -> Evaluation:
    if hf_loss is None:
        return native_evaluation(trained, compute, events, progress, max_batches)
    evaluation = HFEvaluation(
        session=session,
        hf_loss=hf_loss,
        compute_metrics=compute_metrics,
        model=trained.model,
        compute=compute,
        events=events,
        progress=progress,
        max_batches=max_batches,
    )
    evaluation.scheduler = trained.scheduler
    return evaluation


# -- checkpoints ----------------------------------------------------------------------------


class HFSaves(CheckpointManager):
    """The dialect's saves: only those a flag asks for (a signal still saves)."""

    def due_at_end(self, stop_reason: str | None) -> bool:
        return (stop_reason or "").startswith("signal")


def _checkpoints(
    config: CheckpointConfig, root: Path, resuming: bool, *, session: Any
) -> CheckpointManager:
    """As HF: an output_dir that already holds checkpoints is trained into again."""
    manager = HFSaves.from_config(config, root, resuming=True)
    manager.policy = layout.HFRetention(
        **dataclasses.asdict(manager.policy), best_step=lambda: session.state.best_global_step
    )
    return manager
