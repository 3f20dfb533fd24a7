"""``Trainer`` for the HF dialect: transformers' Trainer's API over hookloop's one loop.

It *has* a :class:`hookloop.Trainer` (``trainer.loop``), never is one: steps,
checkpoints and native callbacks are the engine's. HF-style callbacks in
``callbacks`` are wrapped by one :class:`HFSession`; native ones pass through, and
registration order is kept. When ``TrainingArguments`` decide the run, the loop runs
with HF's parts (:mod:`hookloop.compat.hf.parts`: HF's flow at every boundary, its
budget, ``compute_loss``, log keys and evaluation), and checkpoints get HF's
``checkpoint-N`` folders (:mod:`hookloop.compat.hf.layout`).

This file is the class: HF's attributes, and each of transformers' methods handing
its work to the module of its concern (in :mod:`hookloop.compat.hf`: ``arguments``,
``construction``, ``training`` with resuming, ``prediction``, ``results``, ``search``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hookloop.compat.hf import accelerator as hf_accelerator
from hookloop.compat.hf import arguments, construction, prediction, results, search, training
from hookloop.compat.hf import data as hf_data
from hookloop.compat.hf import loss as hf_loss
from hookloop.compat.hf import optim as hf_optim
from hookloop.compat.hf import parts as hf_parts
from hookloop.compat.hf.construction import HF_STEP_OVERRIDES, UNHONOURED_OVERRIDES  # noqa: F401
from hookloop.compat.hf.scripting import ScriptMethods
from hookloop.compat.hf.training import TrainOutput as TrainOutput
from hookloop.compat.hf.types import CONTROL_FLAGS
from hookloop.config import Config, TrainConfig
from hookloop.step import move_to

log = logging.getLogger(__name__)
#: transformers' Trainer logger: the messages transformers' Trainer writes go there too
hf_log = logging.getLogger("transformers.trainer")


def _from_loop(name: str, doc: str | None = None) -> Any:
    """A read-only attribute that is the loop's attribute of the same name."""
    return property(lambda self: getattr(self.loop, name), doc=doc)


class Trainer(construction.BuiltAttributes, ScriptMethods):
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
    label_smoother: Any = None  # transformers' LabelSmoother with label_smoothing_factor
    get_optimizer_cls_and_kwargs = staticmethod(hf_optim.optimizer_cls_and_kwargs)
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
        #: What the loop is built from: by this constructor, by train() when the arguments
        #: changed, and by hyperparameter_search for each trial's trainer.
        self.given = dict(
            args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
            compute_loss_func=compute_loss_func, compute_metrics=compute_metrics,
            callbacks=callbacks, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            test_dataset=test_dataset, config=config, optimizers=optimizers, **native,
        )  # fmt: skip
        self._overridden = _overridden_points(type(self))
        #: What transformers' attributes show of the loop's model, optimizer and schedule.
        self._view = hf_optim.OptimizerView()
        self._build(model, preprocess_logits_for_metrics)

    # -- building -------------------------------------------------------------------------
    def _build(
        self,
        model: torch.nn.Module | None,
        preprocess_logits_for_metrics: Any,
        kept_callbacks: list[Any] | None = None,
    ) -> None:
        """Build HF's objects and the loop from ``self.given`` (``model`` None:
        ``model_init``'s): at construction, and again when ``train()`` finds the
        arguments changed (:func:`hookloop.compat.hf.construction.build`)."""
        self._loaders = hf_data.Loaders()  # how HF builds a loader from a dataset
        built = construction.build(
            self, model, preprocess_logits_for_metrics, view=self._view, loaders=self._loaders,
            overridden=self._overridden, listener=self._mirror,  # handler edits reach the loop
            kept_callbacks=kept_callbacks,
        )  # fmt: skip
        self._memory, self._hf_loss = built.memory, built.hf_loss
        self._accelerator_settings = built.accelerator_settings

    def _rebuild(self, changed: list[str], batch_size: int | None = None) -> None:
        """Build the loop again, as transformers builds its parts at each train() from the
        arguments as they are then (same model and callbacks, a fresh optimizer unless one
        was given, a fresh TrainerState); ``batch_size``: auto_find_batch_size's."""
        log.info("what the loop was built from changed since (%s)", changed)
        model = None if self.model_init is not None else self.model
        kept = list(self.callback_handler.callbacks)
        built = arguments.with_batch_size(self.args_built, batch_size)
        with arguments.batch_size_as_built(self.args, built):
            self._build(model, self.preprocess_logits_for_metrics, kept)
        self.args_built = arguments.with_batch_size(arguments.snapshot(self.args), batch_size)

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
        return self._view.get("model")

    @property
    def optimizer(self) -> Any:
        """The optimizer, as transformers shows it: None until ``create_optimizer()`` or
        ``train()`` (unless given in ``optimizers``). The loop holds it from the start,
        built the same way."""
        return self._view.get("optimizer")

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._view.set("optimizer", value)

    @property
    def lr_scheduler(self) -> Any:
        """The schedule, as transformers shows it: None until ``create_scheduler()`` (which
        makes one for the steps it is given; ``train()`` then uses its own, as
        transformers does) or ``train()``, unless given in ``optimizers``."""
        return self._view.get("lr_scheduler")

    @lr_scheduler.setter
    def lr_scheduler(self, value: Any) -> None:
        self._view.set("lr_scheduler", value)

    scheduler = lr_scheduler
    callbacks = _from_loop(
        "callbacks", "The loop's callback manager (HF's list is ``callback_handler``)."
    )
    ctx = _from_loop("ctx")
    config = _from_loop("config")
    device = _from_loop("device")
    precision = _from_loop("precision")
    train_loader = _from_loop("train_loader")
    eval_loader = _from_loop("eval_loader")
    test_loader = _from_loop("test_loader")
    checkpoints = _from_loop("checkpoints")
    out_dir = _from_loop("out_dir")
    flops_per_sample = _from_loop("flops_per_sample")

    @property
    def model_wrapped(self) -> torch.nn.Module:
        """The module the steps run (DDP's or FSDP's wrapper; the model itself alone)."""
        return self.loop.parts.train_model

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
            cpu = self.device.type == "cpu"
            self._accelerator = hf_accelerator.for_args(
                self._accelerator_settings, self.args, cpu=cpu
            )
        return self._accelerator

    # -- training and evaluation --------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """Train; ``resume_from_checkpoint`` is HF's: a checkpoint path, or True for the
        newest one in ``output_dir``; ``trial`` is what ``model_init(trial)`` gets."""
        training.check_ignore_keys(ignore_keys_for_eval)
        foreign_folder = training.resume(resume_from_checkpoint, args=self.args, loop=self.loop)
        if changed := training.changed_since_build(self):
            self._rebuild(changed)
        call = training.TrainCall(resume_from_checkpoint, trial, ignore_keys_for_eval,
            foreign_folder, built=training.batch_size_built(self), trainer=self,
            rebuild=self._rebuild, run=self._run_loop)  # fmt: skip
        alpha = training.neftune_alpha(self.args, drives_loop=self.hf.drives_loop)
        result = training.run_with_neftune(call.run_all, self.model, alpha)
        return training.output(result, self.hf.summary)

    def _run_loop(self) -> Any:
        """The loop's ``train()``, announced as transformers announces its own."""
        self._view.show_training_objects()
        if self.hf.drives_loop:
            training.announce(self.args, self.loop, self.model, self.hf.foreign_step)
        self._memory.start("train")
        return self.loop.train()

    def evaluate(
        self,
        eval_dataset: Iterable[Any] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """HF's ``evaluate``: the metrics' keys start with ``metric_key_prefix``;
        ``ignore_keys`` are model outputs left out of the predictions."""
        prediction.check_evaluate(metric_key_prefix, ignore_keys)
        sets = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(sets, Mapping):  # each named set, its keys prefixed with its name
            return prediction.evaluate_each(self.evaluate, sets, eval_dataset is not None,
                                            ignore_keys, metric_key_prefix)  # fmt: skip
        loader = functools.partial(self.get_eval_dataloader, eval_dataset)  # asked for in it
        return prediction.evaluate(self.loop, loader, self.hf, self._memory, metric_key_prefix,
                                   ignore_keys)  # fmt: skip

    def test(self, data: Iterable[Any] | None = None) -> dict[str, float]:
        """The native ``test()`` (``on_test_*`` events; keys ``test_*``)."""
        return self.loop.test(self._loaders.load(data, train=False))

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
        prediction.check_predict(test_dataset, metric_key_prefix)
        if "get_test_dataloader" in self._overridden:
            loader = self.get_test_dataloader(test_dataset)
        else:
            loader = self._loaders.load(test_dataset, train=False)
        return prediction.predict(self.loop, loader, self._memory, metric_key_prefix, ignore_keys)

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
        loss, outputs = hf_loss.compute_loss(
            model,
            inputs,
            num_items_in_batch,
            loss_func=self.compute_loss_func,
            label_smoother=self.label_smoother,
            accepts_kwargs=self.model_accepts_loss_kwargs,
        )
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """HF's ``create_optimizer``: the optimizer ``args.optim`` names (or
        ``optimizer_cls_and_kwargs``') for ``model`` (default: the trainer's), unless one
        was given. A subclass may override it, or ``get_optimizer_cls_and_kwargs`` (it runs
        once, when the Trainer is built, where transformers runs it in ``train()``)."""
        if self.optimizer is None:
            if self._view.staged is None:  # after construction: the loop's, built this way
                self._view.shown.add("optimizer")
                return self.optimizer  # type: ignore[return-value]  # now shows the loop's
            model = self.model if model is None else model
            chosen = self.optimizer_cls_and_kwargs
            chosen = chosen or self.get_optimizer_cls_and_kwargs(self.args, model)
            self.optimizer = hf_optim.create_optimizer(model, self.args, cls_and_kwargs=chosen)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """HF's ``create_scheduler``: ``args.lr_scheduler_type`` over ``num_training_steps``,
        unless one was given; sets ``self.lr_scheduler``. A subclass may override it."""
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            if optimizer is None:
                raise ValueError("create_scheduler needs an optimizer: call create_optimizer first")
            made = hf_optim.create_scheduler(optimizer, self.args, num_training_steps)
            self._view.by_create = self._view.staged is None
            try:
                self.lr_scheduler = made
            finally:
                self._view.by_create = False
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
        step = self._hf_required("training_step")
        model.train()
        inputs = move_to(inputs, self.device)
        loss, _ = step(model, inputs, num_items_in_batch)
        scaled = step.scaled(loss, num_items_in_batch, step.group_size)
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

    def _hf_required(self, name: str) -> hf_loss.HFLoss:
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
            count: Any = model.num_parameters  # PreTrainedModel's method
            return 6 * inputs[main].numel() * count(exclude_embeddings=True)
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
        return construction.call_model_init(self.model_init, trial)

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
        return search.hyperparameter_search(
            self,
            hp_space=hp_space,
            compute_objective=compute_objective,
            n_trials=n_trials,
            direction=direction,
            backend=backend,
            hp_name=hp_name,
            kwargs=kwargs,
        )

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
        return [group["lr"] for group in hf_optim.set_up(self.optimizer).param_groups]

    def get_optimizer_group(self, param: Any = None) -> Any:
        """The parameter group holding ``param``, or every group without one."""
        return hf_optim.optimizer_group(hf_optim.set_up(self.optimizer), param)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model for ``from_pretrained`` (``config.json`` and ``model.safetensors``, or
        the state dict alone for a plain module), the processing class and
        ``training_args.bin`` in ``output_dir`` (default ``args.output_dir``)."""
        results.save_model(
            self.model,
            results.output_dir(self.args, output_dir),
            args=self.args,
            processing_class=self.processing_class,
            data_collator=self.data_collator,
        )

    def save_state(self) -> None:
        """``trainer_state.json`` in ``args.output_dir``."""
        results.save_state(self.state, results.output_dir(self.args, None))

    def log_metrics(self, split: str, metrics: Mapping[str, Any]) -> None:
        """Print the metrics under ``***** {split} metrics *****``, as HF does."""
        results.log_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: Mapping[str, Any], combined: bool = True) -> None:
        """``{split}_results.json`` (and ``all_results.json``) in ``args.output_dir``."""
        results.save_metrics(results.output_dir(self.args, None), split, metrics, combined=combined)

    def metrics_format(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """The metrics as ``log_metrics`` prints them."""
        return results.metrics_format(metrics)

    def is_world_process_zero(self) -> bool:
        return results.world_rank() == 0

    def is_local_process_zero(self) -> bool:
        return results.local_rank() == 0

    def _get_output_dir(self, trial: Any = None) -> str | os.PathLike[str]:
        """Where checkpoints go (what transformers' JIT checkpoint callback asks for)."""
        return results.output_dir(self.args, None)

    def _save_checkpoint(self, model: Any, trial: Any = None) -> None:
        """A checkpoint of this exact state, now (what transformers' JIT checkpoint
        callback calls on SIGTERM)."""
        self.loop.save_checkpoint()

    def _load_callback_state(self) -> None:
        """HF's name: restore the callbacks' saved state from ``trainer.state`` (only
        with ``restore_callback_states_from_checkpoint``)."""
        self.hf.restore_callbacks()

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

    def _mirror(self, change: str, callback: Any) -> None:
        """An edit of ``callback_handler`` after construction, made in the loop's manager."""
        if change == "added":
            self.loop.callbacks.add(self.hf.wrap([callback]))
        else:
            self.loop.callbacks.remove(self.hf.unwrap(callback))

    def get_train_dataloader(self) -> Any:
        """HF's training loader for ``train_dataset`` (a subclass may override it)."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            return loop.train_loader
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset")
        return self._loaders.load(self.train_dataset, train=True)

    def get_eval_dataloader(self, eval_dataset: Iterable[Any] | str | None = None) -> Any:
        """HF's evaluation loader of ``eval_dataset`` (default: the trainer's; a name: that
        one of a dict of evaluation datasets). With ``dataloader_persistent_workers`` a
        loader is built once per name and reused, as transformers keeps it."""
        loop = getattr(self, "loop", None)
        return self._loaders.evaluation(
            eval_dataset,
            default=self.eval_dataset,
            built=training.reusable_eval_loader(self, loop),
            persistent=bool(hf_optim.arg(self.args, "dataloader_persistent_workers", False)),
        )

    def get_test_dataloader(self, test_dataset: Iterable[Any]) -> Any:
        """HF's loader for ``test_dataset`` (as an evaluation loader)."""
        if test_dataset is None:
            raise ValueError("get_test_dataloader needs a test_dataset")
        return self._loaders.load(test_dataset, train=False)


def refuse_unhonoured_overrides(cls: type) -> None:
    """Refuse a subclass of :class:`Trainer` that overrides a method the loop never calls."""
    construction.refuse_unhonoured_overrides(cls, Trainer)


def _overridden_points(cls: type) -> frozenset[str]:
    """The override points (:data:`construction.OVERRIDE_POINTS`) ``cls`` replaces."""
    return frozenset(
        name
        for name in construction.OVERRIDE_POINTS
        if getattr(cls, name) is not getattr(Trainer, name)
    )
