"""``Trainer`` for the HF dialect: transformers' Trainer's API over hookloop's one loop.

It *has* a :class:`hookloop.Trainer` (``trainer.loop``), never is one: steps,
checkpoints and native callbacks are the engine's. HF-style callbacks in
``callbacks`` are wrapped by one :class:`HFSession`; native ones pass through, and
registration order is kept. When ``TrainingArguments`` decide the run, the loop runs
with HF's parts (:mod:`hookloop.compat.hf.parts`: HF's flow at every boundary, its
budget, ``compute_loss``, log keys and evaluation), and checkpoints get HF's
``checkpoint-N`` folders (:mod:`hookloop.compat.hf.layout`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import os
import random
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookloop.callback import Callback
from hookloop.compat.hf import accelerator as hf_accelerator
from hookloop.compat.hf import arguments, foreign, layout, reporting, results, search
from hookloop.compat.hf import data as hf_data
from hookloop.compat.hf import optim as hf_optim
from hookloop.compat.hf import parts as hf_parts
from hookloop.compat.hf.adapter import HFSession
from hookloop.compat.hf.evaluation import PredictionOutput
from hookloop.compat.hf.handler import CallbackHandler, DefaultFlowCallback, PrinterCallback
from hookloop.compat.hf.loss import HFLoss, loss_of
from hookloop.compat.hf.memory import MemoryTracker
from hookloop.compat.hf.types import CONTROL_FLAGS, TrainingArguments
from hookloop.config import Config, TrainConfig
from hookloop.loop import Trainer as Loop
from hookloop.manager import CallbackManager
from hookloop.result import TrainResult
from hookloop.step import move_to

log = logging.getLogger(__name__)
#: transformers' Trainer logger: the messages transformers' Trainer writes go there too
hf_log = logging.getLogger("transformers.trainer")


class Trainer:
    """``Trainer(model, args, train_dataset=..., eval_dataset=..., callbacks=[...])``.

    ``args`` (HF names) decides the run unless a hookloop ``config`` is given, in
    which case ``config`` decides it and ``args`` is only what callbacks see; with
    neither, both are the defaults. ``optimizers`` is HF's ``(optimizer,
    lr_scheduler)`` pair. Other keywords (``loss_fn``, ``forward_step``,
    ``out_dir``, ``resume``, ...) are the native trainer's. ``args.output_dir``
    becomes ``out_dir`` (checkpoints) unless ``out_dir`` is given.

    HF's objects are ``trainer.args``, ``trainer.state`` (``TrainerState``),
    ``trainer.control`` (``TrainerControl``) and ``trainer.callback_handler``; the
    loop (``trainer.loop``) keeps its own in ``ctx.state`` / ``ctx.control``. When
    ``args`` decide the run, the callbacks are HF's defaults (``DefaultFlowCallback``
    first, then yours, then ``PrinterCallback`` with ``disable_tqdm`` or
    ``ProgressCallback``).
    """

    #: HF's switch for a ``compute_loss`` override: whether its loss is already the
    #: accumulation group's (None: decided as transformers decides it).
    loss_is_scaled_for_ga: bool | None = None
    #: While the loop is being built: the model, optimizer and schedule create_optimizer /
    #: create_scheduler see and set (None once the loop holds them).
    _staged: dict[str, Any] | None = None
    label_smoother: Any = None  # transformers' LabelSmoother with label_smoothing_factor
    _scheduler_view: Any = None  # a schedule create_scheduler() made after construction
    _shown_by_create = False  # inside create_scheduler() after construction
    _accelerator: Any = None
    _accelerator_settings: dict[str, Any] = hf_accelerator.DEFAULTS

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Iterable[Any] | None = None,
        eval_dataset: Iterable[Any] | None = None,
        processing_class: Any = None,
        model_init: Callable[..., torch.nn.Module] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Any = None,
        *,
        test_dataset: Iterable[Any] | None = None,
        config: Config | TrainConfig | None = None,
        **native: Any,
    ) -> None:
        refuse_unhonoured_overrides(type(self))
        _apply_log_level(args)
        self._eval_sets: dict[str, Any] = {}  # name -> loader, for a dict of eval datasets
        #: What transformers' attributes show of the loop's optimizer and schedule: what
        #: was given in ``optimizers``, and later what create_*() or train() made.
        self._shown = {
            n
            for n, o in zip(("optimizer", "lr_scheduler"), optimizers or (), strict=False)
            if o is not None
        }
        self._eval_loaders: dict[str, Any] = {}  # kept with dataloader_persistent_workers
        skip_memory = args is None or bool(hf_optim.arg(args, "skip_memory_metrics", True))
        self._memory = MemoryTracker(not skip_memory)
        self._memory.start("init")
        # What hyperparameter_search builds each trial's trainer from.
        self.given = dict(
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=model_init,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            test_dataset=test_dataset,
            config=config,
            optimizers=optimizers,
            **native,
        )
        self.objective: float | None = None  # the latest objective of a search's trial
        self.args_built = _snapshot(args)  # the arguments the loop was built from
        if preprocess_logits_for_metrics is not None and not callable(
            preprocess_logits_for_metrics
        ):
            raise TypeError(
                "preprocess_logits_for_metrics must be a function (logits, labels) -> logits, "
                f"got {type(preprocess_logits_for_metrics).__name__}"
            )
        self.model_init = model_init
        if model is None:
            if model_init is None:  # the exception types are transformers'
                raise RuntimeError(
                    "Trainer needs a model or a model_init (a function returning one)"
                )
            model = self.call_model_init()
        elif model_init is not None:
            raise ValueError("give Trainer a model or a model_init, not both")
        if compute_loss_func is not None and not callable(compute_loss_func):
            raise TypeError(
                "compute_loss_func must be a function (outputs, labels, num_items_in_batch=) "
                f"returning the loss, got {type(compute_loss_func).__name__}"
            )
        if optimizer_cls_and_kwargs is not None:
            if optimizers[0] is not None:
                raise ValueError(
                    "give optimizers=(optimizer, ...) or optimizer_cls_and_kwargs, not both"
                )
            if not (
                isinstance(optimizer_cls_and_kwargs, (tuple, list))
                and len(optimizer_cls_and_kwargs) == 2
                and isinstance(optimizer_cls_and_kwargs[0], type)
                and isinstance(optimizer_cls_and_kwargs[1], dict)
            ):
                raise TypeError(
                    "optimizer_cls_and_kwargs must be (an optimizer class, a dict of its "
                    f"keyword arguments), got {optimizer_cls_and_kwargs!r}"
                )
        self.compute_loss_func = compute_loss_func
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        _check(optimizers, native, compute_metrics)
        self.hf = session = HFSession(args, processing_class=processing_class)
        # Arguments decide the run: HF's parts decide each boundary (hookloop.compat.hf.parts).
        session.drives_loop = config is None and args is not None
        # HF's step and evaluation (compute_loss, num_items_in_batch, EvalPrediction)
        # run when the model computes its own loss; a loss_fn or forward_step is native.
        hf_step = session.drives_loop and native.get("loss_fn") is None
        hf_loss = HFLoss(model) if hf_step and native.get("forward_step") is None else None
        self._hf_loss = hf_loss
        if hf_loss is not None:
            own = type(self).compute_loss is not Trainer.compute_loss
            self.label_smoother = _label_smoother(args, model)
            if own or compute_loss_func is not None or self.label_smoother is not None:
                hf_loss.compute_loss = self.compute_loss  # HF's training_step calls it
            hf_loss.has_loss_func = compute_loss_func is not None
            hf_loss.group_size = int(hf_optim.arg(args, "gradient_accumulation_steps", 1))
            if self._overrides("training_step"):
                hf_loss.training_step = self.training_step
            hf_loss.floating_point_ops = self.floating_point_ops
            hf_loss.scaled_for_ga = self.loss_is_scaled_for_ga
        else:
            hf_only = {
                "compute_loss_func": compute_loss_func is not None,
                "preprocess_logits_for_metrics": preprocess_logits_for_metrics is not None,
                **{name: self._overrides(name) for name in HF_STEP_OVERRIDES},
            }
            if any(hf_only.values()):
                raise ValueError(
                    f"{', '.join(k for k, v in hf_only.items() if v)} apply when "
                    "TrainingArguments decide the run and the model computes the loss (no "
                    "config=, loss_fn= or forward_step=)"
                )
        session.compute_metrics = None if hf_loss is not None else compute_metrics
        self._hf_data: dict[str, Any] | None = None  # how HF builds a loader from a dataset
        self.data_collator = data_collator
        run = _Run(config, [train_dataset, eval_dataset, test_dataset], *optimizers)
        if session.drives_loop:
            collator = hf_data.collator_for(data_collator, processing_class)
            self._hf_data = {"args": args, "model": model, "collator": collator}
            self.data_collator = session.data_collator = collator
            run = self._decided_by_args(args, model, run)
            run.dialect = hf_parts.dialect(session, hf_loss, compute_metrics)
        elif data_collator is not None:
            raise ValueError(
                "data_collator is HF's: it applies when TrainingArguments decide the run "
                "(args given, no hookloop config=)"
            )
        if args is not None and native.get("out_dir") is None:
            native["out_dir"] = getattr(args, "output_dir", None)
        members = _as_list(callbacks)
        jit = _jit_checkpoint(args) if session.drives_loop else None
        if session.drives_loop:  # HF's list: the flow, the reporters, yours, the progress
            defaults = [DefaultFlowCallback(), *reporting.loggers(args), *([jit] if jit else [])]
            members = [*defaults, *members, _progress(args)]
        self.callback_handler = handler = CallbackHandler(members)
        session.trainer = self  # what HF callbacks get as ``trainer=``
        self.loop = loop = Loop(
            model,
            run.optimizer,
            train_data=run.datasets[0],
            eval_data=run.datasets[1],
            test_data=run.datasets[2],
            config=run.config,
            callbacks=CallbackManager(session.wrap(handler.callbacks)),
            scheduler=run.scheduler,
            dialect=run.dialect,
            **native,
        )
        handler.model, handler.optimizer, handler.lr_scheduler = (
            loop.model,
            loop.optimizer,
            loop.scheduler,
        )
        handler.processing_class = processing_class
        handler.train_dataloader, handler.eval_dataloader = loop.train_loader, loop.eval_loader
        handler.listener = self._mirror  # each edit of the list after construction reaches the loop
        if session.drives_loop and getattr(loop.model, "config", None) is not None:
            loop.model.config.use_cache = hf_optim.arg(args, "use_cache", False)  # as HF's init
        if jit is not None:  # transformers' own callback: SIGTERM, then a save and a stop
            jit.set_trainer(self)
        self._memory.stop_and_update("init")
        session.before_summary = functools.partial(self._memory.stop_and_update, "train")
        if isinstance(loop.evaluation, hf_parts.HFEvaluation):
            loop.evaluation.prediction_step = self.prediction_step
            loop.evaluation.preprocess_logits = preprocess_logits_for_metrics
            loop.evaluation.eval_sets = self._eval_sets
            if self._overrides("evaluate"):
                loop.evaluation.evaluate_hook = self.evaluate
        elif self._overrides("evaluate"):
            raise ValueError(
                f"{type(self).__name__}.evaluate applies when TrainingArguments decide the run "
                "and the model computes the loss (no config=, loss_fn= or forward_step=)"
            )
        if self._overrides("log"):
            if not isinstance(loop.logbook, hf_parts.HFLogBook):
                raise ValueError(
                    f"{type(self).__name__}.log applies when TrainingArguments decide the run "
                    "(args given, no hookloop config=)"
                )
            loop.logbook.log_hook = self.log
            if isinstance(loop.evaluation, hf_parts.HFEvaluation):
                loop.evaluation.log_hook = self.log

    def _decided_by_args(self, args: Any, model: torch.nn.Module, run: _Run) -> _Run:
        """What ``TrainingArguments`` decide before the loop is built, as HF's Trainer:
        the Config, the seed, HF's loaders, optimizer and LR schedule."""
        settings = hf_accelerator.settings(getattr(args, "accelerator_config", None))
        steps = int(hf_optim.arg(args, "gradient_accumulation_steps", 1))
        if hf_accelerator.accumulation_steps(settings, steps) != steps:  # as transformers sets it
            args.gradient_accumulation_steps = hf_accelerator.accumulation_steps(settings, steps)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        hf_accelerator.check_reproduced(
            settings, world_size=world, trains=run.datasets[0] is not None
        )
        self._accelerator_settings = settings
        arguments.refuse_ignored(args, arguments.honoured_fields(TrainingArguments))
        config = _args_config(args)
        if not config.train.log_every:
            # HF's logged loss (and train_loss) average every step since the last
            # log: the loss window keeps them all, and no step is a native log.
            config.train.log_every = _NO_NATIVE_LOG
        # HF saves where the flags say and on_save clears should_save: at the save step.
        config.checkpoint.async_save = False
        if hf_optim.arg(args, "enable_jit_checkpoint", False):
            config.train.handle_signals = False  # SIGTERM is transformers' JIT callback's
        # HF applies a step whose loss or gradients are NaN/Inf (it only keeps such a loss
        # out of the logged mean, with logging_nan_inf_filter): no step is skipped.
        config.train.skip_nonfinite = False
        _seed_everything(int(hf_optim.arg(args, "seed", 42)))  # as HF's Trainer does
        datasets = [self._loader(d, train=i == 0) for i, d in enumerate(run.datasets)]
        # A subclass's loaders, as transformers asks for them (here once, when the loop is
        # built; an evaluate() or predict() call asks again).
        if self._overrides("get_train_dataloader") and self.train_dataset is not None:
            datasets[0] = self.get_train_dataloader()
        if isinstance(self.eval_dataset, Mapping):  # named sets: each evaluated in turn
            self._eval_sets = {name: self.get_eval_dataloader(name) for name in self.eval_dataset}
            datasets[1] = next(iter(self._eval_sets.values()), None)
        elif self._overrides("get_eval_dataloader") and self.eval_dataset is not None:
            datasets[1] = self.get_eval_dataloader(None)  # positionally, as transformers asks
        elif hf_optim.arg(args, "dataloader_persistent_workers", False):
            self._eval_loaders["eval"] = datasets[1]  # the one loader transformers keeps
        # HF's create_optimizer and create_scheduler (a subclass's overrides included), called
        # before the loop exists: self.model / optimizer / lr_scheduler are the staged ones.
        self._staged = {"model": model, "optimizer": run.optimizer, "lr_scheduler": run.scheduler}
        try:
            if datasets[0] is not None:
                plan = hf_parts.plan_of(args, datasets[0], config.train.grad_accum)
                self.create_optimizer()  # as transformers' train(): these two, in turn
                self.create_scheduler(num_training_steps=plan.max_steps)
            else:  # a trainer that only evaluates: no schedule
                self.create_optimizer()
            optimizer, scheduler = self._staged["optimizer"], self._staged["lr_scheduler"]
        finally:
            self._staged = None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "create_optimizer must leave a torch.optim.Optimizer in self.optimizer, got "
                f"{type(optimizer).__name__}"
            )
        return _Run(config, datasets, optimizer, scheduler)

    # -- HF's objects ---------------------------------------------------------------
    @property
    def args(self) -> Any:
        """The HF-named arguments callbacks receive."""
        return self.hf.args

    @property
    def state(self) -> Any:
        """HF's ``TrainerState`` (the loop's counters are ``trainer.loop.state``)."""
        return self.hf.state

    @state.setter
    def state(self, value: Any) -> None:
        if not hasattr(value, "log_history"):
            raise TypeError(f"trainer.state must be a TrainerState, got {type(value).__name__}")
        self.hf.state = value

    @property
    def control(self) -> Any:
        """HF's ``TrainerControl`` (the loop's requests are ``trainer.loop.control``)."""
        return self.hf.control

    @control.setter
    def control(self, value: Any) -> None:
        if not hasattr(value, "should_training_stop"):
            raise TypeError(f"trainer.control must be a TrainerControl, got {type(value).__name__}")
        if value is not self.hf.control:
            for name in CONTROL_FLAGS:
                setattr(self.hf.control, name, bool(getattr(value, name, False)))

    # -- the loop's objects, under the names users reach for --------------------------
    @property
    def model(self) -> torch.nn.Module:
        if self._staged is not None:
            return self._staged["model"]
        return self.loop.model

    @property
    def optimizer(self) -> Any:
        """The optimizer, as transformers shows it: None until ``create_optimizer()`` or
        ``train()`` (unless given in ``optimizers``). The loop holds it from the start,
        built the same way."""
        if self._staged is not None:
            return self._staged["optimizer"]
        return self.loop.optimizer if "optimizer" in self._shown else None

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._set_staged("optimizer", value)

    @property
    def lr_scheduler(self) -> Any:
        """The schedule, as transformers shows it: None until ``create_scheduler()`` (which
        makes one for the steps it is given; ``train()`` then uses its own, as
        transformers does) or ``train()``, unless given in ``optimizers``."""
        if self._staged is not None:
            return self._staged["lr_scheduler"]
        if self._scheduler_view is not None:
            return self._scheduler_view
        return self.loop.scheduler if "lr_scheduler" in self._shown else None

    @lr_scheduler.setter
    def lr_scheduler(self, value: Any) -> None:
        self._set_staged("lr_scheduler", value)

    scheduler = lr_scheduler

    def _set_staged(self, name: str, value: Any) -> None:
        if self._staged is not None:
            self._staged[name] = value
        elif name == "optimizer" and value is self.loop.optimizer:
            self._shown.add(name)
        elif name == "lr_scheduler" and self._shown_by_create:
            self._scheduler_view = value  # create_scheduler()'s, until train()
        else:
            raise AttributeError(
                f"Trainer.{name} is set by create_optimizer / create_scheduler (override "
                "them, or pass optimizers=(optimizer, lr_scheduler)); the loop already holds "
                f"its {name}"
            )

    def _show_training_objects(self) -> None:
        """From ``train()`` on, the optimizer and schedule the loop trains with are shown;
        a schedule ``create_scheduler()`` made for inspection is dropped (and the rates it
        set back to the loop's), as transformers' ``train()`` makes its own."""
        if self._scheduler_view is not None and self.loop.scheduler is not None:
            for group, lr in zip(
                self.loop.optimizer.param_groups, self.loop.scheduler.get_last_lr(), strict=False
            ):
                group["lr"] = lr
        self._scheduler_view = None
        self._shown.update(("optimizer", "lr_scheduler"))

    @property
    def callbacks(self) -> CallbackManager:
        """The loop's callback manager (HF's list is ``callback_handler``)."""
        return self.loop.callbacks

    @property
    def ctx(self) -> Any:
        return self.loop.ctx

    @property
    def config(self) -> Config:
        return self.loop.config

    @property
    def device(self) -> torch.device:
        return self.loop.device

    @property
    def precision(self) -> Any:
        return self.loop.precision

    @property
    def train_loader(self) -> Any:
        return self.loop.train_loader

    @property
    def eval_loader(self) -> Any:
        return self.loop.eval_loader

    @property
    def test_loader(self) -> Any:
        return self.loop.test_loader

    @property
    def checkpoints(self) -> Any:
        return self.loop.checkpoints

    @property
    def out_dir(self) -> str | None:
        return self.loop.out_dir

    @property
    def flops_per_sample(self) -> float | None:
        return self.loop.flops_per_sample

    # -- training and evaluation --------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """Train; ``resume_from_checkpoint`` is HF's: a checkpoint path, or True for the
        newest one in ``output_dir``; ``trial`` is what ``model_init(trial)`` gets."""
        if ignore_keys_for_eval is not None and not (
            isinstance(ignore_keys_for_eval, (list, tuple))
            and all(isinstance(k, str) for k in ignore_keys_for_eval)
        ):
            raise ValueError(
                f"ignore_keys_for_eval must be a list of output names, got {ignore_keys_for_eval!r}"
            )
        foreign_folder = None  # a checkpoint folder transformers' own Trainer wrote
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            if not isinstance(resume_from_checkpoint, (str, os.PathLike, bool)):
                raise TypeError(
                    "resume_from_checkpoint must be a checkpoint path, True (the newest in "
                    f"output_dir) or None; got {type(resume_from_checkpoint).__name__}"
                )
            if resume_from_checkpoint is True:
                output_dir = self._output_dir(None)
                last = layout.last_checkpoint(output_dir)  # as transformers finds it
                if last is None:  # as transformers: no fresh start
                    raise ValueError(
                        f"No valid checkpoint found in output directory ({output_dir})"
                    )
                _compare_with_checkpoint(self.args, last)
                self.loop.resume_from(layout.native_checkpoint(last))
            else:
                if not os.path.isdir(resume_from_checkpoint):  # transformers' words
                    raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")
                _compare_with_checkpoint(self.args, Path(resume_from_checkpoint))
                target = layout.native_checkpoint(resume_from_checkpoint)
                if layout.written_by_transformers(target):
                    foreign_folder = Path(target)  # read after any rebuild, as transformers
                else:
                    self.loop.resume_from(target)
        changed = _changed(self.args_built, self.args)
        if not changed and self.model_init is not None and self.hf.trained:
            changed = ["model_init: a new model, optimizer and schedule at each train()"]
        if changed:
            # transformers builds the optimizer, schedule and loaders at each train() from
            # the arguments as they are then; the loop here was built from them once, so
            # it is built again (same model and callbacks, a fresh optimizer unless one
            # was given, a fresh TrainerState as transformers' train() starts with).
            log.info("TrainingArguments changed since the Trainer was built (%s)", changed)
            model = None if self.model_init is not None else self.model
            with _batch_size_as_built(self.args, self.args_built):
                Trainer.__init__(self, model, **self.given)
            self.args_built = _snapshot(self.args)
        if self.model_init is not None and self.hf.drives_loop:
            # As transformers: seeded again, the model built anew (its weights copied into
            # the model the optimizer holds), so the data order follows the same RNG.
            _seed_everything(int(hf_optim.arg(self.args, "seed", 42)))
            self.model.load_state_dict(self.call_model_init(trial).state_dict())
        sampler = getattr(self.loop.train_loader, "sampler", None)
        if isinstance(sampler, hf_data.HFSampler) and sampler.follows_torch_seed:
            sampler.seed = torch.initial_seed()  # what accelerate's sampler reads then
        if foreign_folder is not None:
            self._resume_from_transformers(foreign_folder)
        self.hf.summary = {}
        evaluation = self.loop.evaluation
        if isinstance(evaluation, hf_parts.HFEvaluation):
            evaluation.ignore_keys_in_training = ignore_keys_for_eval
        self._show_training_objects()
        self._announce_training()
        self._memory.start("train")
        neftune = self._neftune_on()
        try:
            result = self.loop.train()
        finally:
            if neftune is not None:
                from transformers.integrations import deactivate_neftune

                deactivate_neftune(self.model, neftune)
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        fields["metrics"] = {**fields["metrics"], **self.hf.summary}
        return TrainOutput(**fields)

    def _announce_training(self) -> None:
        """transformers' start-of-training summary, at info level on its logger."""
        if not self.hf.drives_loop or not hf_log.isEnabledFor(logging.INFO):
            return
        args, loader = self.args, self.loop.train_loader
        k = int(hf_optim.arg(args, "gradient_accumulation_steps", 1))
        per_device = int(hf_optim.arg(args, "per_device_train_batch_size", 8))
        world = self.loop.progress.world_size
        plan = hf_parts.plan_of(args, loader, k) if loader is not None else None
        examples = (
            len(loader.dataset) if hasattr(getattr(loader, "dataset", None), "__len__") else "?"
        )
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        for line in (
            "***** Running training *****",
            f"  Num examples = {examples:,}" if examples != "?" else "  Num examples = ?",
            f"  Num Epochs = {plan.num_epochs if plan and plan.num_epochs else '?'}",
            f"  Num update steps per epoch = {plan.steps_per_epoch if plan else '?'}",
            f"  Instantaneous batch size per device = {per_device:,}",
            f"  Total train batch size (w. parallel, distributed & accumulation) = "
            f"{per_device * k * world:,}",
            f"  Gradient Accumulation steps = {k}",
            f"  Total optimization steps = {plan.max_steps if plan else '?'}",
            f"  Number of trainable parameters = {trainable:,}",
        ):
            hf_log.info(line)

    def _neftune_on(self) -> Any:
        """``neftune_noise_alpha``: transformers' NEFTune hook on the input embeddings for
        this train() (its handle; None when off)."""
        alpha = (
            hf_optim.arg(self.args, "neftune_noise_alpha", None) if self.hf.drives_loop else None
        )
        if alpha is None:
            return None
        if not hasattr(self.model, "get_input_embeddings"):
            raise ValueError(
                "neftune_noise_alpha adds noise to the model's input embeddings: the model "
                f"({type(self.model).__name__}) has no get_input_embeddings()"
            )
        from transformers.integrations import activate_neftune

        return activate_neftune(self.model, alpha)

    def _resume_from_transformers(self, folder: Path) -> None:
        """Load a folder transformers' Trainer wrote (:mod:`hookloop.compat.hf.foreign`)."""
        if not self.hf.drives_loop or self.loop.train_loader is None:
            raise ValueError(
                f"{folder} was written by transformers' Trainer: resuming from it needs "
                "TrainingArguments to decide the run (no hookloop config=) and a train_dataset"
            )
        k = int(hf_optim.arg(self.args, "gradient_accumulation_steps", 1))
        plan = hf_parts.plan_of(self.args, self.loop.train_loader, k)
        batch = int(hf_optim.arg(self.args, "per_device_train_batch_size", 8))
        step = foreign.resume(
            folder,
            self.loop.checkpointer.named_state(),
            steps_per_epoch=plan.steps_per_epoch,
            samples_per_step=batch * k * self.loop.progress.world_size,
        )
        log.info("resumed from %s (written by transformers' Trainer) at step %d", folder, step)

    def evaluate(
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
        sets = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(sets, Mapping):  # each named set, its keys prefixed with its name
            metrics: dict[str, float] = {}
            for name, one in sets.items():
                chosen = one if eval_dataset is not None else name
                metrics.update(self.evaluate(chosen, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        self._memory.start("eval")
        evaluation = self.loop.evaluation
        hf_evaluation = isinstance(evaluation, hf_parts.HFEvaluation)
        if hf_evaluation:
            evaluation.prefix, evaluation.ignore_keys = metric_key_prefix, ignore_keys
        try:
            metrics = self.loop.evaluate(self.get_eval_dataloader(eval_dataset))
        finally:
            if hf_evaluation:
                evaluation.prefix = evaluation.ignore_keys = None
        if self.hf.drives_loop:  # HF's log() adds the epoch to the dict evaluate returns
            metrics["epoch"] = self.hf.state.epoch
        self._memory.stop_and_update("eval", metrics)
        return metrics

    def test(self, data: Iterable[Any] | None = None) -> dict[str, float]:
        """The native ``test()`` (``on_test_*`` events; keys ``test_*``)."""
        return self.loop.test(self._loader(data, train=False))

    def predict(
        self,
        test_dataset: Iterable[Any],
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> Any:
        """HF's ``predict``: a :class:`PredictionOutput` of the predictions (the model's
        outputs but the loss), the ``label_ids`` (None without labels) and the metrics
        (``test_loss``, the speed, ``compute_metrics``'s, all prefixed), firing
        ``on_predict``. With a native step (``loss_fn``/``forward_step``) it is the native
        ``predict()``: what ``loss_func`` returns, batch by batch."""
        if not isinstance(metric_key_prefix, str) or not metric_key_prefix:
            raise ValueError(
                f"metric_key_prefix must be a non-empty string, got {metric_key_prefix!r}"
            )
        if test_dataset is None:
            raise ValueError("predict() needs a test_dataset")
        evaluation = self.loop.evaluation
        if self._overrides("get_test_dataloader"):
            loader = self.get_test_dataloader(test_dataset)
        else:
            loader = self._loader(test_dataset, train=False)
        if not isinstance(evaluation, hf_parts.HFEvaluation):
            return self.loop.predict(loader)  # type: ignore[arg-type]
        evaluation.prefix, evaluation.ignore_keys = metric_key_prefix, ignore_keys
        evaluation.keep_predictions = True
        self._memory.start("test")
        try:
            metrics = self.loop.test(loader)
        finally:
            evaluation.prefix = evaluation.ignore_keys = None
            evaluation.keep_predictions = False
        self._memory.stop_and_update("test", metrics)
        collected, evaluation.last = evaluation.last, None
        predictions, label_ids = collected.predictions() if collected else (None, None)
        return PredictionOutput(predictions, label_ids, metrics)

    def save_checkpoint(self) -> Path | None:
        return self.loop.save_checkpoint()

    def load_checkpoint(self, target: str) -> Path | None:
        return self.loop.load_checkpoint(target)

    # -- HF's override points -------------------------------------------------------------
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """HF's ``compute_loss``: the model's own loss (``compute_loss_func(outputs, labels,
        num_items_in_batch=)`` when given). A subclass may override it; the loop calls
        it for every training micro-batch and every evaluation batch with labels."""
        inputs = dict(inputs)
        labels = None
        taken = self.compute_loss_func is not None or self.label_smoother is not None
        if taken and "labels" in inputs:
            labels = inputs.pop("labels")
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs["num_items_in_batch"] = num_items_in_batch
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:  # label_smoothing_factor: transformers' LabelSmoother
            shift = _is_causal_lm(model)
            loss = self.label_smoother(
                outputs, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch
            )
        else:
            loss = loss_of(outputs, inputs)
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """HF's ``create_optimizer``: the optimizer ``args.optim`` names (or
        ``optimizer_cls_and_kwargs``') for ``model`` (default: the trainer's), unless one
        was given. A subclass may override it (it runs once, when the Trainer is built,
        where transformers runs it in ``train()``); it sets ``self.optimizer``."""
        if self.optimizer is None:
            if self._staged is None:  # after construction: the loop's, built this way
                self._shown.add("optimizer")
                return self.optimizer
            self.optimizer = hf_optim.create_optimizer(
                self.model if model is None else model,
                self.args,
                cls_and_kwargs=self.optimizer_cls_and_kwargs,
            )
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """HF's ``create_scheduler``: ``args.lr_scheduler_type`` over ``num_training_steps``,
        unless one was given; sets ``self.lr_scheduler``. A subclass may override it."""
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            if optimizer is None:
                raise ValueError("create_scheduler needs an optimizer: call create_optimizer first")
            made = hf_optim.create_scheduler(optimizer, self.args, num_training_steps)
            self._shown_by_create = self._staged is None
            try:
                self.lr_scheduler = made
            finally:
                self._shown_by_create = False
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """``create_optimizer()`` then ``create_scheduler()``. As in transformers 5,
        ``train()`` calls those two itself, not this method."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps)

    def training_step(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """HF's ``training_step`` for one micro-batch: ``compute_loss``, divided by the
        accumulation group's size unless it is the group's already, back-propagated;
        returns the loss detached. A subclass may override it (the loop then calls it
        for every training micro-batch, as transformers does)."""
        hf_loss = self._hf_required("training_step")
        model.train()
        inputs = move_to(inputs, self.device)
        loss, _ = hf_loss(model, inputs, num_items_in_batch)
        scaled = hf_loss.scaled(loss, num_items_in_batch, hf_loss.group_size)
        self.loop.precision.backward(scaled)
        return scaled.detach()

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """HF's ``prediction_step``: ``(loss, logits, labels)`` of one evaluation batch
        (``(loss, None, None)`` with ``prediction_loss_only``). A subclass may override
        it; every evaluation and ``predict()`` batch goes through it."""
        self._hf_required("prediction_step")
        evaluation = self.loop.evaluation
        assert isinstance(evaluation, hf_parts.HFEvaluation)
        return evaluation.default_prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    @property
    def current_gradient_accumulation_steps(self) -> int:
        """The micro-batches of the update being run (fewer for an epoch's last group)."""
        if self._hf_loss is None:
            return self.config.train.grad_accum
        return self._hf_loss.group_size

    def _hf_required(self, name: str) -> HFLoss:
        if self._hf_loss is None:
            raise RuntimeError(
                f"{name} is HF's step: it runs when TrainingArguments decide the run and the "
                "model computes the loss (no config=, loss_fn= or forward_step=)"
            )
        return self._hf_loss

    def floating_point_ops(self, inputs: Mapping[str, Any]) -> float:
        """A micro-batch's forward and backward FLOPs for ``total_flos``: 6 x the main
        input's elements x the parameters outside the embeddings, for a model with
        ``num_parameters`` (a ``PreTrainedModel``); 0 otherwise. A subclass may override it."""
        model = self.model
        main = getattr(model, "main_input_name", "input_ids")
        if main in inputs and hasattr(model, "num_parameters"):
            return 6 * inputs[main].numel() * model.num_parameters(exclude_embeddings=True)
        return 0

    @property
    def model_accepts_loss_kwargs(self) -> bool:
        """Whether ``num_items_in_batch`` reaches the model's ``forward`` (and its loss is
        then the accumulation group's); set it to False to have the loss divided."""
        if self._hf_loss is None:
            return False
        return self._hf_loss.accepts_kwargs

    @model_accepts_loss_kwargs.setter
    def model_accepts_loss_kwargs(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"model_accepts_loss_kwargs must be True or False, got {value!r}")
        if self._hf_loss is not None:
            self._hf_loss.accepts_kwargs = value

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """``model_init()`` (or ``model_init(trial)`` when it takes one argument)."""
        init = self.model_init
        if init is None:
            raise ValueError("call_model_init needs model_init= (a function returning a model)")
        takes = len(inspect.signature(init).parameters)
        if takes == 0:
            model = init()
        elif takes == 1:
            model = init(trial)
        else:
            raise ValueError("model_init must take no argument or one (the trial)")
        if model is None:
            raise ValueError("model_init returned None; it must return the model to train")
        return model

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``hyperparameter_search`` with the Optuna backend
        (:mod:`hookloop.compat.hf.search`): each trial sets ``hp_space(trial)`` on the
        arguments, builds the model with ``model_init`` and trains; returns the
        ``BestRun`` (a list of them for several directions)."""
        backend = getattr(backend, "value", backend)
        if backend not in (None, "optuna"):
            raise ValueError(
                f"hyperparameter_search backend {backend!r} is not supported by "
                "hookloop.compat.hf.Trainer; allowed: 'optuna'"
            )
        if self.model_init is None:
            raise RuntimeError(
                "hyperparameter_search needs the model through model_init (a function "
                "returning a fresh one for each trial)"
            )
        if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
            raise ValueError(f"n_trials must be an int >= 1, got {n_trials!r}")

        def build(trial: Any) -> Trainer:  # as transformers: a fresh optimizer for each trial
            args = copy.copy(self.args)  # the trial's values (batch size too) are on self.args
            run = hp_name(trial) if hp_name is not None else f"run-{trial.number}"
            args.output_dir = os.path.join(self.args.output_dir, run)  # transformers' run dir
            given = {**self.given, "args": args, "optimizers": (None, None)}
            return type(self)(None, **given)

        best, last = search.run_optuna(
            build,
            self.args,
            hp_space=hp_space or search.default_hp_space_optuna,
            compute_objective=compute_objective or search.default_compute_objective,
            hp_name=hp_name,
            n_trials=n_trials,
            direction=direction,
            kwargs=kwargs,
        )
        if last is not None:  # as transformers: the trainer holds the last trial's run
            self.model.load_state_dict(last.model.state_dict())
            self.hf.state = last.state
            if self.args_built is not None:  # and trains on with the last trial's batch size
                batch = self.args.per_device_train_batch_size
                self.args_built["per_device_train_batch_size"] = batch
        return best

    # -- after train(): what transformers' example scripts call -------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """HF's ``log``: ``logs`` (with the epoch) to ``log_history`` and every
        callback's ``on_log``. A subclass may override it to add or change keys; the
        loop hands it each training log, the end-of-training summary and
        ``evaluate()``'s metrics, as transformers does. Called from a callback or an
        override point, it logs the dict at the current step."""
        if not isinstance(logs, dict):
            raise TypeError(f"log() takes a dict of values to log, got {type(logs).__name__}")
        session = self.hf
        if session.evaluating:  # evaluate()'s metrics: the evaluation's log event logs them
            return
        if session.state.epoch is not None:
            logs["epoch"] = session.state.epoch
        self.loop.logbook.publish(logs)

    def get_num_trainable_parameters(self) -> int:
        """The parameters the optimizer can change (``requires_grad``), counted."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """Each parameter group's current learning rate."""
        return [group["lr"] for group in self._optimizer_set_up().param_groups]

    def get_optimizer_group(self, param: Any = None) -> Any:
        """The parameter group holding ``param``, or every group without one."""
        groups = self._optimizer_set_up().param_groups
        if param is None:
            return groups
        for group in groups:
            if any(p is param for p in group["params"]):
                return group
        raise ValueError(f"parameter {param!r} is in no optimizer group")

    def _optimizer_set_up(self) -> Any:
        if self.optimizer is None:  # transformers' words
            raise ValueError(
                "Trainer optimizer is None, please make sure you have setup the optimizer before."
            )
        return self.optimizer

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model for ``from_pretrained`` (``config.json`` and ``model.safetensors``, or
        the state dict alone for a plain module), the processing class and
        ``training_args.bin`` in ``output_dir`` (default ``args.output_dir``)."""
        results.save_model(
            self.model,
            self._output_dir(output_dir),
            args=self.args,
            processing_class=self.processing_class,
            data_collator=self.data_collator,
        )

    def save_state(self) -> None:
        """``trainer_state.json`` in ``args.output_dir``."""
        results.save_state(self.state, self._output_dir(None))

    def log_metrics(self, split: str, metrics: Mapping[str, Any]) -> None:
        """Print the metrics under ``***** {split} metrics *****``, as HF does."""
        results.log_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: Mapping[str, Any], combined: bool = True) -> None:
        """``{split}_results.json`` (and ``all_results.json``) in ``args.output_dir``."""
        results.save_metrics(self._output_dir(None), split, metrics, combined=combined)

    def metrics_format(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """The metrics as ``log_metrics`` prints them."""
        return results.metrics_format(metrics)

    def is_world_process_zero(self) -> bool:
        return results.world_rank() == 0

    def is_local_process_zero(self) -> bool:
        return results.local_rank() == 0

    def _get_output_dir(self, trial: Any = None) -> str | os.PathLike[str]:
        """Where checkpoints go (what transformers' JIT checkpoint callback asks for)."""
        return self._output_dir(None)

    def _save_checkpoint(self, model: Any, trial: Any = None) -> None:
        """A checkpoint of this exact state, now (what transformers' JIT checkpoint
        callback calls on SIGTERM)."""
        self.loop.save_checkpoint()

    def _output_dir(self, given: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
        out = given if given is not None else getattr(self.args, "output_dir", None)
        if out is None:
            raise ValueError("no output_dir: set TrainingArguments.output_dir or pass one")
        return out

    # -- HF's callback list and loaders ---------------------------------------------------
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
        """HF's training loader for ``train_dataset`` (a subclass may override it)."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            return loop.train_loader
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset")
        return self._loader(self.train_dataset, train=True)

    def _overrides(self, name: str) -> bool:
        """Whether this Trainer's class replaces the method ``name`` of this one."""
        return getattr(type(self), name) is not getattr(Trainer, name)

    def get_eval_dataloader(self, eval_dataset: Iterable[Any] | str | None = None) -> Any:
        """HF's evaluation loader of ``eval_dataset`` (default: the trainer's; a name: that
        one of a dict of evaluation datasets). With ``dataloader_persistent_workers`` a
        loader is built once per name and reused, as transformers keeps it."""
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        if isinstance(eval_dataset, str):
            sets = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {}
            if eval_dataset not in sets:
                raise ValueError(
                    f"get_eval_dataloader({eval_dataset!r}): the evaluation datasets are "
                    f"{', '.join(map(repr, sets)) or 'not a dict of named datasets'}"
                )
            data: Any = sets[eval_dataset]
        elif eval_dataset is not None:
            data = eval_dataset
        else:
            loop = getattr(self, "loop", None)
            if loop is not None and loop.eval_loader is not None and not self._eval_sets:
                return loop.eval_loader
            if self.eval_dataset is None:
                raise ValueError("Trainer: evaluation requires an eval_dataset")
            if isinstance(self.eval_dataset, Mapping):
                raise ValueError(
                    "the evaluation datasets are a dict: name one of "
                    f"{', '.join(map(repr, self.eval_dataset))}"
                )
            data = self.eval_dataset
        persistent = bool(hf_optim.arg(self.args, "dataloader_persistent_workers", False))
        if persistent and key in self._eval_loaders:
            return self._eval_loaders[key]
        loader = self._loader(data, train=False)
        if persistent:
            self._eval_loaders[key] = loader
        return loader

    def get_test_dataloader(self, test_dataset: Iterable[Any]) -> Any:
        """HF's loader for ``test_dataset`` (as an evaluation loader)."""
        if test_dataset is None:
            raise ValueError("get_test_dataloader needs a test_dataset")
        return self._loader(test_dataset, train=False)

    @property
    def accelerator(self) -> Any:
        """An ``accelerate.Accelerator`` with ``accelerator_config``'s settings (built when
        first asked for; the loop does not run on it): see
        :mod:`hookloop.compat.hf.accelerator`."""
        if self._accelerator is None:
            if not self.hf.drives_loop:
                raise AttributeError(
                    "trainer.accelerator exists when TrainingArguments decide the run"
                )
            precision = "fp16" if hf_optim.arg(self.args, "fp16", False) else "no"
            if hf_optim.arg(self.args, "bf16", False):
                precision = "bf16"
            self._accelerator = hf_accelerator.build(
                self._accelerator_settings,
                cpu=self.device.type == "cpu",
                mixed_precision=precision,
            )
        return self._accelerator

    @property
    def model_wrapped(self) -> torch.nn.Module:
        """The module the steps run (DDP's or FSDP's wrapper; the model itself alone)."""
        return self.loop.parts.train_model

    def _load_callback_state(self) -> None:
        """HF's name: restore the callbacks' saved state from ``trainer.state`` (only
        with ``restore_callback_states_from_checkpoint``)."""
        self.hf.restore_callbacks()

    def _mirror(self, change: str, callback: Any) -> None:
        """An edit of ``callback_handler`` after construction, made in the loop's manager."""
        if change == "added":
            self.loop.callbacks.add(self.hf.wrap([callback]))
        else:
            self.loop.callbacks.remove(self.hf.unwrap(callback))

    def _loader(self, data: Iterable[Any] | None, *, train: bool) -> Iterable[Any] | None:
        """HF's DataLoader for a dataset when ``args`` decide the run
        (:mod:`hookloop.compat.hf.data`); loaders, other data and None pass through."""
        hf = self._hf_data
        hf_dataset = hf_data.is_map_dataset(data) or isinstance(
            data, torch.utils.data.IterableDataset
        )
        if hf is None or data is None or not hf_dataset:
            return data
        return hf_data.make_loader(data, train=train, **hf)


_NO_NATIVE_LOG = 2**62


@dataclasses.dataclass
class _Run:
    """What the loop is built with: the config, the data, optimizer and LR schedule, and
    HF's parts when ``TrainingArguments`` decide the run."""

    config: Config | TrainConfig | None
    datasets: list[Any]
    optimizer: Any
    scheduler: Any
    dialect: Any = None


_HF_NAME = {
    "train_data": "train_dataset",
    "eval_data": "eval_dataset",
    "test_data": "test_dataset",
    "callbacks": "callbacks",
    "scheduler": "optimizers=(optimizer, lr_scheduler)",
    "dialect": "TrainingArguments (args decide the run's parts)",
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


#: transformers' Trainer methods a subclass overrides to change training or evaluation
#: that this Trainer does not call: a subclass defining one is refused at construction
#: (its override would be skipped silently). ``compute_loss``, ``floating_point_ops`` and
#: ``get_train/eval/test_dataloader`` are honoured.
#: HF's per-batch override points: they run in the HF step and evaluation only.
HF_STEP_OVERRIDES = ("compute_loss", "training_step", "prediction_step")

UNHONOURED_OVERRIDES = (
    "autocast_smart_context_manager",
    "compute_loss_context_manager",
    "evaluation_loop",
    "get_batch_samples",
    "get_decay_parameter_names",
    "get_optimizer_cls_and_kwargs",
    "num_examples",
    "save_model",
    "set_initial_training_values",
    "store_flos",
)


def refuse_unhonoured_overrides(cls: type) -> None:
    """Refuse a subclass of :class:`Trainer` that overrides a method the loop never calls."""
    for klass in cls.__mro__:
        if klass is Trainer or not issubclass(klass, Trainer):
            continue
        for name in UNHONOURED_OVERRIDES:
            if name in vars(klass):
                raise TypeError(
                    f"{klass.__name__}.{name} overrides a method hookloop.compat.hf.Trainer "
                    "does not call, so it would be skipped; of transformers' override points "
                    "this Trainer honours compute_loss, training_step, prediction_step, "
                    "evaluate, log, create_optimizer, create_scheduler, floating_point_ops "
                    "and get_train/eval/test_dataloader"
                )


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


def _check(optimizers: Any, native: dict[str, Any], compute_metrics: Any) -> None:
    if not (isinstance(optimizers, (tuple, list)) and len(optimizers) == 2):
        raise ValueError(
            "optimizers must be a pair (optimizer, lr_scheduler), either may be None; "
            f"got {optimizers!r}"
        )
    for key in ("train_data", "eval_data", "test_data", "callbacks", "scheduler", "dialect"):
        if key in native:
            raise TypeError(
                f"hookloop.compat.hf.Trainer takes HF's names: use {_HF_NAME[key]} instead of {key}"
            )
    if compute_metrics is not None and not callable(compute_metrics):
        raise TypeError(
            "compute_metrics must be a function of an EvalPrediction returning a dict, "
            f"got {type(compute_metrics).__name__}"
        )


def _snapshot(args: Any) -> dict[str, Any] | None:
    """The arguments' fields as they are now (None: not a dataclass, nothing compared)."""
    if args is None or not dataclasses.is_dataclass(args):
        return None
    values = {}
    for field in dataclasses.fields(args):
        try:
            values[field.name] = copy.deepcopy(getattr(args, field.name))
        except Exception:
            continue
    return values


def _changed(before: dict[str, Any] | None, args: Any) -> list[str]:
    """The fields of ``args`` that differ from ``before``."""
    if before is None:
        return []
    changed = []
    for name, value in before.items():
        try:
            same = bool(getattr(args, name, value) == value)
        except Exception:
            same = True
        if not same:
            changed.append(name)
    return changed


@contextlib.contextmanager
def _batch_size_as_built(args: Any, built: dict[str, Any] | None) -> Any:
    """transformers fixes the training batch size when its Trainer is built (a later
    ``per_device_train_batch_size`` is not used by ``train()``): the loop is rebuilt
    with the one it was built with, and ``args`` keeps the user's value."""
    name = "per_device_train_batch_size"
    given = getattr(args, name, None)
    if built is None or built.get(name) is None or given is None:
        yield
        return
    setattr(args, name, built[name])
    try:
        yield
    finally:
        setattr(args, name, given)


def _seed_everything(seed: int) -> None:
    """HF's ``set_seed``: Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _progress(args: Any) -> Any:
    """HF's progress display: ``PrinterCallback`` with ``disable_tqdm``, else the
    ``ProgressCallback`` (Forgather's, which takes transformers' constructor too)."""
    if getattr(args, "disable_tqdm", False):
        return PrinterCallback()
    # hookloop.compat.forgather builds on this package, so it is looked up when a
    # Trainer is built, not imported with this module
    forgather = importlib.import_module("hookloop.compat.forgather.callbacks")
    return forgather.ProgressCallback()


_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
               "error": logging.ERROR, "critical": logging.CRITICAL}  # fmt: skip


def _apply_log_level(args: Any) -> None:
    """``log_level``: the verbosity of transformers' loggers (and so of the dialect's
    messages on them); ``"passive"`` leaves it alone, as transformers does."""
    level = hf_optim.arg(args, "log_level", "passive") if args is not None else "passive"
    if level == "passive":
        return
    if level not in _LOG_LEVELS:
        raise ValueError(
            f"TrainingArguments.log_level must be one of passive, {', '.join(_LOG_LEVELS)}; "
            f"got {level!r}"
        )
    logging.getLogger("transformers").setLevel(_LOG_LEVELS[level])


def _compare_with_checkpoint(args: Any, folder: Path) -> None:
    """transformers' warning when the arguments' intervals or batch size differ from those
    in the checkpoint's ``trainer_state.json`` (a resume goes on with the arguments')."""
    try:
        saved = json.loads((folder / layout.TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no readable trainer_state.json: the resume itself says what is wrong
    if not isinstance(saved, dict):
        return
    differ = []
    for name in ("logging_steps", "eval_steps", "save_steps"):
        ours, theirs = getattr(args, name, None), saved.get(name)
        if ours is not None and theirs is not None and ours != theirs:
            differ.append((name, ours, theirs))
    batch = getattr(args, "per_device_train_batch_size", None)
    if isinstance(saved.get("train_batch_size"), int) and batch != saved["train_batch_size"]:
        differ.append(("per_device_train_batch_size", batch, saved["train_batch_size"]))
    if differ:
        hf_log.warning(
            "The arguments differ from the checkpoint's trainer_state.json: "
            + "; ".join(
                f"{k}: {a} (from args) != {b} (from trainer_state.json)" for k, a, b in differ
            )
        )


def _is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether transformers lists the model's class as a causal LM (its label smoothing then
    shifts the labels by one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _label_smoother(args: Any, model: torch.nn.Module) -> Any:
    """transformers' ``LabelSmoother`` for ``label_smoothing_factor`` (None when 0, or, with a
    warning as transformers gives, for a multi-label classifier)."""
    epsilon = float(hf_optim.arg(args, "label_smoothing_factor", 0.0) or 0.0)
    if not epsilon:
        return None
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    if problem == "multi_label_classification":
        warnings.warn(
            "Label smoothing is not compatible with multi-label classification: training "
            "this run without it (label_smoothing_factor ignored, as transformers does)",
            UserWarning,
            stacklevel=4,
        )
        return None
    try:
        from transformers.trainer_pt_utils import LabelSmoother
    except ImportError:
        raise ValueError(
            "label_smoothing_factor uses transformers' LabelSmoother: install transformers, "
            "or leave label_smoothing_factor=0"
        ) from None
    return LabelSmoother(epsilon=epsilon)


def _jit_checkpoint(args: Any) -> Any:
    """transformers' ``JITCheckpointCallback`` for ``enable_jit_checkpoint`` (None when off)."""
    if not hf_optim.arg(args, "enable_jit_checkpoint", False):
        return None
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    return JITCheckpointCallback()


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes)):
        raise TypeError(f"callbacks must be callback objects, got the string {callbacks!r}")
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
        return [callbacks]
    return list(callbacks)
