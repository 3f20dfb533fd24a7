"""``Trainer`` for the HF dialect: the native trainer, built the HuggingFace way.

It is :class:`hookloop.Trainer` (a subclass), so steps, checkpoints and native
callbacks are the engine's. HF-style callbacks in ``callbacks`` are wrapped by
one :class:`HFSession`; native ones pass through, and registration order is
kept. When ``TrainingArguments`` decide the run, the boundaries are HF's: the
epoch loop, the step boundary and the log are overridden to follow
``transformers.Trainer`` (:mod:`hookloop.compat.hf.flow`), and checkpoints get
HF's ``checkpoint-N`` folders (:mod:`hookloop.compat.hf.layout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import random
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from hookloop.callback import Callback
from hookloop.checkpoint import CheckpointManager
from hookloop.compat.hf import data as hf_data
from hookloop.compat.hf import flow, layout, reporting
from hookloop.compat.hf import optim as hf_optim
from hookloop.compat.hf.adapter import HFSession
from hookloop.compat.hf.evaluation import Evaluation, ignored_keys
from hookloop.compat.hf.handler import CallbackHandler, DefaultFlowCallback, PrinterCallback
from hookloop.compat.hf.loss import HFLoss
from hookloop.compat.hf.types import CONTROL_FLAGS, TrainingArguments
from hookloop.config import Config, TrainConfig
from hookloop.distributed import no_gradient_sync
from hookloop.manager import CallbackManager
from hookloop.result import TrainResult, is_abort
from hookloop.rundir import RunDir
from hookloop.state import Control, TrainState
from hookloop.step import move_to, to_float
from hookloop.trainer import Trainer as NativeTrainer


class Trainer(NativeTrainer):
    """``Trainer(model, args, train_dataset=..., eval_dataset=..., callbacks=[...])``.

    ``args`` (HF names) decides the run unless a hookloop ``config`` is given, in
    which case ``config`` decides it and ``args`` is only what callbacks see; with
    neither, both are the defaults. ``optimizers`` is HF's ``(optimizer,
    lr_scheduler)`` pair. Other keywords (``loss_fn``, ``forward_step``,
    ``out_dir``, ``resume``, ...) are the native trainer's. ``args.output_dir``
    becomes ``out_dir`` (checkpoints) unless ``out_dir`` is given.

    HF's objects are ``trainer.args``, ``trainer.state`` (``TrainerState``),
    ``trainer.control`` (``TrainerControl``) and ``trainer.callback_handler``; the
    loop's own are ``ctx.state`` / ``ctx.control``. When ``args`` decide the run,
    the callbacks are HF's defaults (``DefaultFlowCallback`` first, then yours,
    then ``PrinterCallback`` with ``disable_tqdm`` or ``ProgressCallback``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        args: Any = None,
        *,
        train_dataset: Iterable[Any] | None = None,
        eval_dataset: Iterable[Any] | None = None,
        test_dataset: Iterable[Any] | None = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        processing_class: Any = None,
        compute_metrics: Any = None,
        data_collator: Any = None,
        config: Config | TrainConfig | None = None,
        **native: Any,
    ) -> None:
        if not (isinstance(optimizers, (tuple, list)) and len(optimizers) == 2):
            raise ValueError(
                "optimizers must be a pair (optimizer, lr_scheduler), either may be None; "
                f"got {optimizers!r}"
            )
        for key in ("train_data", "eval_data", "test_data", "callbacks", "scheduler"):
            if key in native:
                raise TypeError(
                    f"hookloop.compat.hf.Trainer takes HF's names: use "
                    f"{_HF_NAME[key]} instead of {key}"
                )
        if compute_metrics is not None and not callable(compute_metrics):
            raise TypeError(
                "compute_metrics must be a function of an EvalPrediction returning a dict, "
                f"got {type(compute_metrics).__name__}"
            )
        self.hf = HFSession(args, processing_class=processing_class)
        # Arguments decide the run: HF's flow decides each boundary (see flow.py).
        self.hf.drives_loop = config is None and args is not None
        # HF's step and evaluation (compute_loss, num_items_in_batch, EvalPrediction)
        # run when the model computes its own loss; a loss_fn or forward_step is native.
        hf_step = self.hf.drives_loop and native.get("loss_fn") is None
        self._hf_loss = HFLoss(model) if hf_step and native.get("forward_step") is None else None
        self._compute_metrics = compute_metrics
        self.hf.compute_metrics = None if self._hf_loss is not None else compute_metrics
        self._metric_prefix: str | None = None
        self._ignore_keys: list[str] | None = None
        self._hf_lr: float | None = None
        self._hf_summary: dict[str, Any] = {}
        optimizer, scheduler = optimizers
        self._hf_data = self.hf.drives_loop
        if self.hf.drives_loop:
            _refuse_unsupported(args)
            config = _args_config(args)
            if not config.train.log_every:
                # HF's logged loss (and train_loss) average every step since the last
                # log: the loss window keeps them all, and no step is a native log.
                config.train.log_every = _NO_NATIVE_LOG
            # HF saves where the flags say and on_save clears should_save: at the save step.
            config.checkpoint.async_save = False
            _seed_everything(int(hf_optim.arg(args, "seed", 42)))  # as HF's Trainer does
            self._hf_model = model
            self._collator = hf_data.collator_for(data_collator, processing_class)
            train_dataset = self._loader(train_dataset, train=True)
            eval_dataset = self._loader(eval_dataset, train=False)
            test_dataset = self._loader(test_dataset, train=False)
            if optimizer is None:
                optimizer = hf_optim.create_optimizer(model, args)
            if scheduler is None and train_dataset is not None:
                plan = _hf_plan(args, train_dataset, config.train.grad_accum)
                scheduler = hf_optim.create_scheduler(optimizer, args, plan.max_steps)
        elif data_collator is not None:
            raise ValueError(
                "data_collator is HF's: it applies when TrainingArguments decide the run "
                "(args given, no hookloop config=)"
            )
        if args is not None and native.get("out_dir") is None:
            native["out_dir"] = getattr(args, "output_dir", None)
        members = _as_list(callbacks)
        if self.hf.drives_loop:  # HF's list: the flow, the reporters, yours, the progress
            members = [DefaultFlowCallback(), *reporting.loggers(args), *members, _progress(args)]
        self.callback_handler = _TrainerHandler(members)
        manager = CallbackManager(self.hf.wrap(self.callback_handler.callbacks))
        super().__init__(
            model,
            optimizer,
            train_data=train_dataset,
            eval_data=eval_dataset,
            test_data=test_dataset,
            config=config,
            callbacks=manager,
            scheduler=scheduler,
            **native,
        )
        self.hf.state._link(self._native_state)
        self.hf.control._link(self._native_control)
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = (
            self.model,
            self.optimizer,
            self.scheduler,
        )
        handler.processing_class = processing_class
        handler.train_dataloader, handler.eval_dataloader = self.train_loader, self.eval_loader
        handler.trainer = self
        self._hf_ready = True
        if self.hf.drives_loop and getattr(self.model, "config", None) is not None:
            self.model.config.use_cache = hf_optim.arg(args, "use_cache", False)  # as HF's init

    @property
    def state(self) -> Any:
        """HF's ``TrainerState`` (the loop's counters stay in ``ctx.state``)."""
        d = self.__dict__
        return d["hf"].state if d.get("_hf_ready") else d["_native_state"]

    @state.setter
    def state(self, value: Any) -> None:
        if isinstance(value, TrainState):
            self.__dict__["_native_state"] = value
            return
        if not hasattr(value, "log_history"):
            raise TypeError(f"trainer.state must be a TrainerState, got {type(value).__name__}")
        value._link(self.__dict__["_native_state"])
        self.hf.state = value

    @property
    def control(self) -> Any:
        """HF's ``TrainerControl`` (the loop's requests stay in ``ctx.control``)."""
        d = self.__dict__
        return d["hf"].control if d.get("_hf_ready") else d["_native_control"]

    @control.setter
    def control(self, value: Any) -> None:
        if isinstance(value, Control):
            self.__dict__["_native_control"] = value
            return
        if not hasattr(value, "should_training_stop"):
            raise TypeError(f"trainer.control must be a TrainerControl, got {type(value).__name__}")
        if value is not self.hf.control:
            for name in CONTROL_FLAGS:
                setattr(self.hf.control, name, bool(getattr(value, name, False)))

    @property
    def args(self) -> Any:
        """The HF-named arguments callbacks receive."""
        return self.hf.args

    # -- HF's flow (when TrainingArguments decide the run) -------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:  # type: ignore[override]
        """Train; ``resume_from_checkpoint`` is HF's: a checkpoint path, or True for the
        newest one in ``output_dir``."""
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            if not isinstance(resume_from_checkpoint, (str, os.PathLike, bool)):
                raise TypeError(
                    "resume_from_checkpoint must be a checkpoint path, True (the newest in "
                    f"output_dir) or None; got {type(resume_from_checkpoint).__name__}"
                )
            self.resume = (
                "auto"
                if resume_from_checkpoint is True
                else layout.native_checkpoint(resume_from_checkpoint)
            )
            if self.checkpoints is None:
                self.checkpoints = self._checkpoint_manager()
        self._hf_summary = {}
        result = super().train()
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        fields["metrics"] = {**fields["metrics"], **self._hf_summary}
        return TrainOutput(**fields)

    def _checkpoint_manager(self) -> CheckpointManager | None:
        if not self.hf.drives_loop:
            return super()._checkpoint_manager()
        if self.out_dir is None and self.resume is None:
            return None
        # As HF: an output_dir that already holds checkpoints is trained into again.
        run = RunDir(self.out_dir) if self.out_dir else RunDir.of_checkpoint(str(self.resume))
        manager = _HFSaves.from_config(self.config.checkpoint, run.checkpoints, resuming=True)
        manager.policy = layout.HFRetention(**dataclasses.asdict(manager.policy))
        return manager

    def _run_epoch(self) -> None:
        """HF's epoch: ``on_epoch_begin`` always (also on a resume mid-epoch), the
        steps until the data, the budget or a flag ends it, then ``on_epoch_end``
        (also for a partial epoch) and the epoch's log, evaluation and save."""
        if not self.hf.drives_loop:
            super()._run_epoch()
            return
        st, control, k = self.state, self.hf.control, self.config.train.grad_accum
        # Opening a loader draws its worker seed from torch's RNG. Resumed mid-epoch,
        # the checkpoint's RNG state already follows that draw: undo this one (as HF
        # restores its RNG after skipping into the epoch), so dropout goes on as before.
        rng = torch.get_rng_state() if st._epoch_step and self._hf_data else None
        micro_batches = self._data.epoch(st._epoch, st._epoch_step)
        if rng is not None:
            torch.set_rng_state(rng)
        self._fire("on_epoch_start")
        exhausted = stopped = False
        while st._max_steps is None or st._step < st._max_steps:
            group = list(itertools.islice(micro_batches, k))
            if not group:
                exhausted = True
                break
            self._train_step(group)  # HF steps on an epoch's last, partial group too
            if self._step_boundary():
                stopped = True
                break
            if control.should_epoch_stop:
                break
            if len(group) < k:
                exhausted = True
                break
        if is_abort(st._stop_reason):
            return
        complete = exhausted or st._epoch_step == st._steps_per_epoch
        self._fire("on_epoch_end")
        if complete or (control.should_epoch_stop and not stopped):
            st._epoch += 1
            st._epoch_step = 0
        if self._hf_boundary() and st._stop_reason is None:
            st._stop_reason = "stopped at the epoch end"
        if st._stop_reason is None and st._num_epochs is not None and st._epoch >= st._num_epochs:
            st._stop_reason = "max_epochs"
        if st._stop_reason is None and st._max_steps is not None and st._step >= st._max_steps:
            st._stop_reason = "max_steps"
        if st._stop_reason is not None and not is_abort(st._stop_reason):
            self._hf_finish()

    def _step_boundary(self) -> bool:
        if not self.hf.drives_loop:
            return super()._step_boundary()
        return self._hf_boundary()

    def _hf_boundary(self) -> bool:
        """``_maybe_log_save_evaluate`` on the flags the handlers left set; True to stop."""
        st, control, session = self.state, self.hf.control, self.hf
        requests = self._take_requests()  # native callbacks' requests join HF's flags
        control.should_log |= requests.log
        control.should_evaluate |= requests.evaluate
        if control.should_log and st._step > session.last_logged_step:
            self._log()
        if control.should_evaluate and self.eval_loader is not None:
            self._evaluate_in_training()
        requests = requests.merge(self._take_requests())  # filed by log or eval handlers
        if requests.abort:
            st._stop_reason = f"abort: {requests.abort}"
            return True
        control.should_save |= requests.save
        saves = control.should_save and self.checkpoints is not None
        if saves and self.save_checkpoint() is None and session.last_checkpoint is not None:
            # HF saves a step twice (a step save, then an epoch save): on_save fires twice
            self._fire_checkpoint_event("on_checkpoint_save", session.last_checkpoint)
        if control.should_training_stop and st._stop_reason is None:
            at_budget = st._max_steps is not None and st._step >= st._max_steps
            st._stop_reason = "max_steps" if at_budget else requests.stop or "should_training_stop"
            return True
        return self._requests_stop(requests)

    def _log_due(self) -> bool:
        """``ctx.state.will_log`` by HF's logging schedule: the steps strategy (the
        native schedule), the first step with ``logging_first_step``, an epoch's last
        step with the epoch strategy. A callback may still clear ``should_log``."""
        due = super()._log_due()
        if not self.hf.drives_loop or due:
            return due
        args, st = self.hf.args, self.state
        if st._step == 1 and getattr(args, "logging_first_step", False):
            return True
        last_of_epoch = st._epoch_step == st._steps_per_epoch or (
            st._max_steps is not None and st._step >= st._max_steps
        )
        return flow.strategy(args, "logging_strategy") == "epoch" and last_of_epoch

    def _log(self) -> None:
        """A log with HF's keys: the mean loss since the last log, grad_norm,
        learning_rate and epoch."""
        if not self.hf.drives_loop:
            super()._log()
            return
        st, window, session = self.state, self._losses, self.hf
        self._sync_tokens()
        steps = st._step - session.last_logged_step
        keys, means = window.means()
        logs: dict[str, Any] = {}
        if means is not None:
            loss = dict(zip(keys, means.tolist(), strict=True)).get("loss", 0.0)
            logs["loss"] = loss
            session.total_loss += loss * steps
        if window.grad_norm is not None:
            logs["grad_norm"] = to_float(window.grad_norm)
        # HF logs the rate the last step used (read before its scheduler step)
        lr = self._hf_lr if self._hf_lr is not None else self.optimizer.param_groups[0]["lr"]
        logs["learning_rate"] = float(lr)
        logs["epoch"] = session.state.epoch
        window.clear()
        session.last_logged_step = st._step
        self._fire_log(logs)

    def _fire_log(self, logs: dict[str, Any]) -> None:
        if self._hooks["on_before_log"] or self._hooks["on_log"]:
            self.ctx.logs = logs
            self._fire("on_before_log")
            self._fire("on_log")
            self.ctx.logs = None
        self._last_logs = logs

    def _hf_finish(self) -> None:
        """HF's end of training, before ``on_train_end``: the summary log, then the
        best checkpoint's weights when ``load_best_model_at_end``."""
        st, session, window = self.state, self.hf, self._losses
        self._sync_tokens()
        keys, means = window.means()
        if means is not None:
            loss = dict(zip(keys, means.tolist(), strict=True)).get("loss", 0.0)
            session.total_loss += loss * (st._step - session.last_logged_step)
        steps = st._step - session.first_step
        summary = flow.train_summary(
            time.monotonic() - session.train_start,
            samples=st._samples - session.first_samples,
            steps=steps,
            total_flos=float(st._flops),
            train_loss=session.total_loss / max(steps, 0.001),
        )
        self.hf.refresh(self.ctx, "on_log")
        summary["epoch"] = session.state.epoch
        self._hf_summary = summary
        self._fire_log(summary)
        session.load_best_model(self.ctx)

    # -- HF's data, step and evaluation (when TrainingArguments decide the run) -----
    def _loader(self, data: Iterable[Any] | None, *, train: bool) -> Iterable[Any] | None:
        """HF's DataLoader for a dataset (hookloop.compat.hf.data); loaders pass through."""
        hf_dataset = hf_data.is_map_dataset(data) or isinstance(
            data, torch.utils.data.IterableDataset
        )
        if not self.__dict__.get("_hf_data") or data is None or not hf_dataset:
            return super()._loader(data, train=train)
        return hf_data.make_loader(
            data, args=self.hf.args, model=self._hf_model, collator=self._collator, train=train
        )

    def _plan_budget(self) -> None:
        """HF's budget: an epoch is ``ceil(batches / gradient_accumulation_steps)``
        steps, ``num_train_epochs`` may be fractional; ``epoch`` counts micro-batches."""
        st, k = self.state, self.config.train.grad_accum
        plan = _hf_plan(self.hf.args, self.train_loader, k) if self.hf.drives_loop else None
        if plan is None or not plan.batches:  # a stream: max_steps decides (checked there)
            super()._plan_budget()
            return
        st._steps_per_epoch, st._max_steps, st._num_epochs = (
            plan.steps_per_epoch,
            plan.max_steps,
            plan.num_epochs,
        )
        self.hf.state.count_epochs_in_batches(plan.batches, k)

    def _forward_backward(self, group: list[Any]) -> None:
        """HF's ``training_step`` for each micro-batch (``compute_loss`` and its
        accumulation scaling); the step's loss is the sum of the scaled losses."""
        if self._hf_loss is None or not isinstance(group[0], Mapping):
            super()._forward_backward(group)
            return
        st, hooks, ctx, hf_loss = self.state, self._hooks, self.ctx, self._hf_loss
        k, model, precision = len(group), self._train_model, self.precision
        num_items = hf_loss.items_in_batch(group)
        step_loss: torch.Tensor | None = None
        for i, batch in enumerate(group):
            st._micro_step = i
            if hooks["on_micro_step_start"]:
                ctx.batch = batch
                self.callbacks.fire("on_micro_step_start", ctx)
            sync = contextlib.nullcontext() if i == k - 1 else no_gradient_sync(model)
            with precision.autocast(), sync:
                loss, outputs = hf_loss(model, move_to(batch, self.device), num_items)
                scaled = hf_loss.scaled(loss, num_items, k)
                precision.backward(scaled)
            part = scaled.detach()
            step_loss = part if step_loss is None else step_loss + part
            if hooks["on_micro_step_end"]:
                ctx.batch, ctx.outputs, ctx.loss = batch, outputs, loss.detach()
                self.callbacks.fire("on_micro_step_end", ctx)
                ctx.outputs = ctx.loss = None
            ctx.batch = None
        st._micro_step = 0
        self._reducer.add((step_loss, {}))

    def _prepare_gradients(self) -> torch.Tensor | None:
        """HF clips to ``max_grad_norm`` and always reports the norm (unclipped when 0)."""
        if not self.hf.drives_loop or self._reducer.token_mode:
            return super()._prepare_gradients()
        self.precision.unscale(self.optimizer)
        limit = hf_optim.arg(self.hf.args, "max_grad_norm", 1.0)
        return torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), limit if limit and limit > 0 else float("inf")
        )

    def _optimizer_step(self, loss_dict: dict[str, Any], grad_norm: torch.Tensor | None) -> bool:
        self._hf_lr = float(self.optimizer.param_groups[0]["lr"])
        return super()._optimizer_step(loss_dict, grad_norm)

    def evaluate(  # type: ignore[override]
        self,
        eval_dataset: Iterable[Any] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """HF's ``evaluate``: the metrics' keys start with ``metric_key_prefix``;
        ``ignore_keys`` are model outputs left out of the predictions."""
        if not isinstance(metric_key_prefix, str) or not metric_key_prefix:
            raise ValueError(
                f"metric_key_prefix must be a non-empty string, got {metric_key_prefix!r}"
            )
        if ignore_keys is not None and not all(isinstance(k, str) for k in ignore_keys):
            raise ValueError(f"ignore_keys must be a list of output names, got {ignore_keys!r}")
        self._metric_prefix, self._ignore_keys = metric_key_prefix, ignore_keys
        try:
            metrics = super().evaluate(eval_dataset)
        finally:
            self._metric_prefix = self._ignore_keys = None
        if self.hf.drives_loop:  # HF's log() adds the epoch to the dict evaluate returns
            metrics["epoch"] = self.hf.state.epoch
        return metrics

    def _run_eval_loop(self, loader: Iterable[Any], kind: str) -> dict[str, float]:
        """HF's ``evaluation_loop``: the loss per sample, then ``compute_metrics``."""
        if self._hf_loss is None:
            return super()._run_eval_loop(loader, kind)
        st, ctx, hooks, model, hf_loss = (
            self.state,
            self.ctx,
            self._hooks,
            self.model,
            self._hf_loss,
        )
        args = self.hf.args
        prefix = kind if kind != "eval" or self._metric_prefix is None else self._metric_prefix
        evaluation = Evaluation(
            hf_data.label_names(model, args),
            self._ignore_keys if self._ignore_keys is not None else ignored_keys(model),
            self._compute_metrics,
            list(hf_optim.arg(args, "include_for_metrics", []) or []),
            nan_filter=bool(hf_optim.arg(args, "logging_nan_inf_filter", True)),
        )
        was_training = model.training
        model.eval()
        self._fire(f"on_{kind}_start")
        with torch.no_grad():
            for batch in itertools.islice(loader, self.config.train.eval_max_batches):
                if hooks[f"on_{kind}_step_start"]:
                    ctx.batch = batch
                    self.callbacks.fire(f"on_{kind}_step_start", ctx)
                inputs = move_to(batch, self.device)
                loss = None
                with self.precision.autocast():
                    if evaluation.has_labels(inputs):
                        num_items = hf_loss.items_in_batch([inputs])
                        loss, outputs = hf_loss(model, inputs, num_items)
                        loss = loss.detach().mean()
                    else:
                        outputs = model(**inputs)
                evaluation.add(inputs, loss, outputs)
                if hooks[f"on_{kind}_step_end"]:
                    ctx.batch, ctx.outputs, ctx.loss = batch, outputs, loss
                    self.callbacks.fire(f"on_{kind}_step_end", ctx)
                ctx.batch = ctx.outputs = ctx.loss = None
        metrics = evaluation.metrics(prefix)
        if kind == "eval":
            st._last_eval = metrics
        ctx.metrics = metrics
        self._fire(f"on_{kind}_end")
        ctx.metrics = None
        model.train(was_training)
        return metrics

    def add_callback(self, callback: Any) -> None:
        """Add an HF-style or native callback (instance or HF class), as HF's Trainer does."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return the first callback of a class, or that instance (None if absent)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove the first callback of a class, or that instance."""
        self.callback_handler.remove_callback(callback)

    def get_train_dataloader(self) -> Any:
        """HF's name for the training loader."""
        return self.train_loader

    def get_eval_dataloader(self) -> Any:
        """HF's name for the evaluation loader."""
        return self.eval_loader

    def _load_callback_state(self) -> None:
        """HF's name: restore the callbacks' saved state from ``trainer.state`` (only
        with ``restore_callback_states_from_checkpoint``)."""
        self.hf.restore_callbacks()


_NO_NATIVE_LOG = 2**62

_HF_NAME = {
    "train_data": "train_dataset",
    "eval_data": "eval_dataset",
    "test_data": "test_dataset",
    "callbacks": "callbacks",
    "scheduler": "optimizers=(optimizer, lr_scheduler)",
}


def _args_config(args: Any) -> Config:
    """The Config that runs ``args``; a transformers ``TrainingArguments`` is read by name."""
    if isinstance(args, TrainingArguments):
        return args.to_config()
    fields = {
        name: getattr(args, name)
        for name in TrainingArguments.__dataclass_fields__
        if hasattr(args, name)
    }
    return TrainingArguments(**fields).to_config()


#: transformers' fields that would change the numbers or the flow, with the value the
#: dialect runs (a transformers ``TrainingArguments`` set otherwise is refused).
_UNSUPPORTED = {
    "label_smoothing_factor": 0.0,
    "neftune_noise_alpha": None,
    "gradient_checkpointing": False,
    "eval_on_start": False,
    "include_num_input_tokens_seen": "no",
    "torch_compile": False,
    "auto_find_batch_size": False,
    "full_determinism": False,
}


def _refuse_unsupported(args: Any) -> None:
    """Name the transformers fields set to what the dialect does not reproduce."""
    odd = {
        name: getattr(args, name)
        for name, value in _UNSUPPORTED.items()
        if hasattr(args, name) and getattr(args, name) != value
    }
    if odd:
        raise ValueError(
            "hookloop.compat.hf.Trainer does not reproduce "
            + ", ".join(f"{k}={v!r}" for k, v in odd.items())
            + "; leave them at "
            + ", ".join(f"{k}={_UNSUPPORTED[k]!r}" for k in odd)
        )


class _HFSaves(CheckpointManager):
    """The dialect's saves: only those a flag asks for (a signal still saves)."""

    def due_at_end(self, stop_reason: str | None) -> bool:
        return (stop_reason or "").startswith("signal")


@dataclasses.dataclass
class TrainOutput(TrainResult):
    """The native result, also read by HF's names: ``global_step``,
    ``training_loss`` (the summary log's ``train_loss``) and ``metrics`` (HF's
    summary, after the last evaluation's metrics); unpacks as HF's triple."""

    @property
    def global_step(self) -> int:
        return self.step

    @property
    def training_loss(self) -> float | None:
        return self.logs.get("train_loss")

    def __iter__(self) -> Any:
        """Unpacks as HF's ``(global_step, training_loss, metrics)``."""
        return iter((self.global_step, self.training_loss, self.metrics))

    def __getitem__(self, i: int) -> Any:
        return tuple(self)[i]


@dataclasses.dataclass(frozen=True)
class _Plan:
    batches: int
    steps_per_epoch: int
    max_steps: int
    num_epochs: int | None


def _hf_plan(args: Any, loader: Any, grad_accum: int) -> _Plan:
    """``set_initial_training_values``: steps per epoch (a partial last group
    counts), the step budget and the epochs it spans."""
    max_steps = hf_optim.arg(args, "max_steps", -1)
    try:
        batches = len(loader)
    except TypeError:  # a stream has no length: the budget is max_steps
        if max_steps <= 0:
            raise ValueError(
                "the train data has no length (a stream), so TrainingArguments.max_steps must "
                f"be > 0 to say how long to train; got max_steps={max_steps}"
            ) from None
        return _Plan(0, max_steps, max_steps, None)
    if batches == 0:
        raise ValueError("the train data has no batch (fewer samples than a batch, with drop_last)")
    per_epoch = max(math.ceil(batches / grad_accum), 1)
    if max_steps > 0:
        return _Plan(batches, per_epoch, max_steps, None)
    epochs = float(hf_optim.arg(args, "num_train_epochs", 3.0))
    return _Plan(batches, per_epoch, math.ceil(epochs * per_epoch), math.ceil(epochs))


def _seed_everything(seed: int) -> None:
    """HF's ``set_seed``: Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _TrainerHandler(CallbackHandler):
    """The dialect Trainer's list: each edit after construction reaches the loop."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.trainer: Any = None
        super().__init__(callbacks)

    def _added(self, cb: Any) -> None:
        if self.trainer is not None:
            self.trainer.callbacks.add(self.trainer.hf.wrap([cb]))

    def _removed(self, cb: Any) -> None:
        if self.trainer is not None:
            self.trainer.callbacks.remove(self.trainer.hf.unwrap(cb))


def _progress(args: Any) -> Any:
    """HF's progress display: ``PrinterCallback`` with ``disable_tqdm``, else the
    ``ProgressCallback`` (seed 004's, which takes transformers' constructor too)."""
    if getattr(args, "disable_tqdm", False):
        return PrinterCallback()
    from hookloop.compat.hf.seed004 import ProgressCallback

    return ProgressCallback()


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes)):
        raise TypeError(f"callbacks must be callback objects, got the string {callbacks!r}")
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
        return [callbacks]
    return list(callbacks)
