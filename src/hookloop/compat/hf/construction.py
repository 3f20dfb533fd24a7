"""Building the parts of :class:`hookloop.compat.hf.Trainer`, as transformers' Trainer
builds its own: the constructor's checks, HF's step (``compute_loss`` and the override
points wired into it), what ``TrainingArguments`` decide before the loop exists (the
Config, the seed, the loaders, ``create_optimizer`` and ``create_scheduler``), HF's
callback list, the loop, and the hooks that reach the loop's evaluation and log.

:func:`build` runs them in transformers' order, at construction and again when
``train()`` finds the arguments changed, and fills the Trainer's transformers
attributes (``args``' objects, ``hf``, ``callback_handler``, ``loop``); each function
it calls takes what it needs and returns what it made. The Trainer's override points
(``create_optimizer``, ``get_eval_dataloader``, ...) run during the build and see
what is built so far, as in transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookloop.compat._toolkit import as_list
from hookloop.compat.hf import accelerator as hf_accelerator
from hookloop.compat.hf import arguments, console, reporting, switches
from hookloop.compat.hf import data as hf_data
from hookloop.compat.hf import optim as hf_optim
from hookloop.compat.hf import parts as hf_parts
from hookloop.compat.hf.adapter import HFSession
from hookloop.compat.hf.handler import CallbackHandler, DefaultFlowCallback
from hookloop.compat.hf.loss import HFLoss, label_smoother_for
from hookloop.compat.hf.memory import MemoryTracker
from hookloop.compat.hf.plain_args import check_training_fields
from hookloop.compat.hf.training_args import PlainSeq2SeqTrainingArguments, is_dialect_args
from hookloop.config import Config, TrainConfig
from hookloop.loop import Trainer as Loop
from hookloop.manager import CallbackManager

#: transformers' Trainer methods a subclass may override that the build wires in.
OVERRIDE_POINTS = (
    "compute_loss",
    "training_step",
    "prediction_step",
    "evaluate",
    "log",
    "get_train_dataloader",
    "get_eval_dataloader",
    "get_test_dataloader",
)

#: HF's per-batch override points: they run in the HF step and evaluation only.
HF_STEP_OVERRIDES = ("compute_loss", "training_step", "prediction_step")

#: transformers' Trainer methods a subclass overrides to change training or evaluation
#: that this Trainer does not call: a subclass defining one is refused at construction
#: (its override would be skipped silently). ``compute_loss``, ``floating_point_ops`` and
#: ``get_train/eval/test_dataloader`` are honoured.
UNHONOURED_OVERRIDES = (
    "autocast_smart_context_manager",
    "compute_loss_context_manager",
    "evaluation_loop",
    "get_batch_samples",
    "get_decay_parameter_names",
    "num_examples",
    "save_model",
    "set_initial_training_values",
    "store_flos",
)


def refuse_unhonoured_overrides(cls: type, base: type) -> None:
    """Refuse a subclass ``cls`` of the Trainer ``base`` that overrides a method the loop
    never calls."""
    for klass in cls.__mro__:
        if klass is base or not issubclass(klass, base):
            continue
        for name in UNHONOURED_OVERRIDES:
            if name in vars(klass):
                raise TypeError(
                    f"{klass.__name__}.{name} overrides a method hookloop.compat.hf.Trainer "
                    "does not call, so it would be skipped; of transformers' override points "
                    "this Trainer honours compute_loss, training_step, prediction_step, "
                    "evaluate, log, create_optimizer, get_optimizer_cls_and_kwargs, "
                    "create_scheduler, floating_point_ops and get_train/eval/test_dataloader"
                )


#: The constructor's own arguments; any other keyword is the native trainer's.
NAMED = frozenset(
    {"args", "data_collator", "train_dataset", "eval_dataset", "processing_class", "model_init",
     "compute_loss_func", "compute_metrics", "callbacks", "optimizer_cls_and_kwargs",
     "test_dataset", "config", "optimizers"}
)  # fmt: skip

#: A log interval no step reaches: HF's logs are its flow's, never the native loop's.
NO_NATIVE_LOG = 2**62

#: The native keyword each of HF's names stands for, in the refusal of the native one.
HF_NAMES = {
    "train_data": "train_dataset",
    "eval_data": "eval_dataset",
    "test_data": "test_dataset",
    "callbacks": "callbacks",
    "scheduler": "optimizers=(optimizer, lr_scheduler)",
    "dialect": "TrainingArguments (args decide the run's parts)",
}

_DECIDED_BY_ARGS = "when TrainingArguments decide the run"
_HF_STEP_ONLY = (
    f"{_DECIDED_BY_ARGS} and the model computes the loss (no config=, loss_fn= or forward_step=)"
)


@dataclasses.dataclass
class Run:
    """What the loop is built with: the config, the data, optimizer and LR schedule, and
    HF's parts when ``TrainingArguments`` decide the run."""

    config: Config | TrainConfig | None
    datasets: list[Any]
    optimizer: Any
    scheduler: Any
    dialect: Any = None


@dataclasses.dataclass
class Built:
    """What a build leaves to the Trainer's own keeping."""

    memory: MemoryTracker  # transformers' memory metrics (skip_memory_metrics=False)
    hf_loss: HFLoss | None  # HF's step, None for a native one
    accelerator_settings: dict[str, Any]  # accelerator_config's, for trainer.accelerator


class BuiltAttributes:
    """The transformers attributes :func:`build` sets on the Trainer (at construction and
    at each rebuild), declared for readers and the type checker."""

    hf: HFSession  # what HF callbacks receive: args, state, control, the session's hooks
    loop: Loop  # the native loop this Trainer runs
    callback_handler: CallbackHandler
    model_init: Callable[..., torch.nn.Module] | None
    train_dataset: Any
    eval_dataset: Any
    data_collator: Any
    processing_class: Any
    compute_loss_func: Callable[..., Any] | None
    optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None
    args_built: Any  # the arguments the loop was built from (arguments.snapshot)


def build(
    trainer: Any,
    model: torch.nn.Module | None,
    preprocess_logits: Any,
    *,
    view: hf_optim.OptimizerView,
    loaders: hf_data.Loaders,
    overridden: frozenset[str],
    listener: Callable[[str, Any], None],
    kept_callbacks: list[Any] | None = None,
) -> Built:
    """Build HF's objects and the loop from ``trainer.given`` onto ``trainer`` (its
    transformers attributes, ``hf``, ``callback_handler`` and ``loop``), in the order
    transformers' Trainer builds its own (``model`` None: ``model_init``'s). The
    trainer's override points run meanwhile, seeing what is built so far.
    ``kept_callbacks``: a rebuild keeps the callback list as it stands (transformers'
    handler outlives ``train()``: callbacks added or removed since construction stay so)."""
    given, args = trainer.given, trainer.given["args"]
    native = {k: v for k, v in given.items() if k not in NAMED}
    arguments.apply_log_level(args)
    console.announce_max_steps(args)
    view.show_given(given["optimizers"])
    memory = MemoryTracker(args is not None and not hf_optim.arg(args, "skip_memory_metrics", True))
    memory.start("init")
    trainer.objective = None  # the latest objective of a search's trial
    trainer.args_built = arguments.snapshot(args)  # the arguments the loop was built from
    check_preprocess(preprocess_logits)
    trainer.model_init = given["model_init"]
    model = model_to_train(model, trainer.model_init, trainer.call_model_init)
    check_given(given, native)
    _take_given(trainer, given, preprocess_logits)
    trainer.hf = session = HFSession(args, processing_class=trainer.processing_class)
    # Arguments decide the run: HF's parts decide each boundary (hookloop.compat.hf.parts).
    session.drives_loop = given["config"] is None and args is not None
    hf_loss = hf_step(trainer, model, args, native, overridden)
    session.metrics_of = None if hf_loss is not None else lambda: trainer.compute_metrics
    datasets = [given["train_dataset"], given["eval_dataset"], given["test_dataset"]]
    run = Run(given["config"], datasets, *given["optimizers"])
    settings = hf_accelerator.DEFAULTS
    if session.drives_loop:
        run, settings = _decided_by_args(trainer, model, run, view, loaders, overridden, hf_loss)
    elif trainer.data_collator is not None:
        raise ValueError(
            "data_collator is HF's: it applies when TrainingArguments decide the run "
            "(args given, no hookloop config=)"
        )
    if args is not None and native.get("out_dir") is None:
        native["out_dir"] = getattr(args, "output_dir", None)
    trainer.loop = view.loop = _loop_with_callbacks(
        trainer, model, run, native, listener, kept_callbacks
    )
    memory.stop_and_update("init")
    session.before_summary = functools.partial(memory.stop_and_update, "train")
    if session.drives_loop:
        switches.connect(trainer.loop, session, args, trainer.processing_class)
    connect_hooks(trainer, trainer.loop, overridden, preprocess_logits=preprocess_logits,
                  eval_sets=loaders.eval_sets)  # fmt: skip
    loaders.built_from = (trainer.eval_dataset, loaders.collator())  # the loop's eval loader's
    return Built(memory, hf_loss, settings)


def _take_given(trainer: Any, given: Mapping[str, Any], preprocess_logits: Any) -> None:
    """The constructor's arguments, under transformers' attribute names."""
    trainer.compute_loss_func = given["compute_loss_func"]
    trainer.optimizer_cls_and_kwargs = given["optimizer_cls_and_kwargs"]
    trainer.train_dataset, trainer.eval_dataset = given["train_dataset"], given["eval_dataset"]
    trainer.processing_class = given["processing_class"]
    trainer.compute_metrics = given["compute_metrics"]
    trainer.preprocess_logits_for_metrics = preprocess_logits
    trainer.data_collator = given["data_collator"]


def _decided_by_args(
    trainer: Any,
    model: torch.nn.Module,
    run: Run,
    view: hf_optim.OptimizerView,
    loaders: hf_data.Loaders,
    overridden: frozenset[str],
    hf_loss: HFLoss | None,
) -> tuple[Run, dict[str, Any]]:
    """What ``TrainingArguments`` decide before the loop is built, as HF's Trainer: the
    collator, the Config, the seed, HF's loaders, optimizer and LR schedule, HF's parts;
    and ``accelerator_config``'s settings."""
    args = trainer.given["args"]
    collator = hf_data.collator_for(trainer.data_collator, trainer.processing_class)
    loaders.spec = {"args": args, "model": model, "collator": collator}
    trainer.data_collator = trainer.hf.data_collator = collator
    loaders.collator_of = lambda: trainer.data_collator  # as transformers reads it
    config, settings = run_config(args, trains=run.datasets[0] is not None)
    arguments.seed_everything(int(hf_optim.arg(args, "seed", 42)))  # as HF's Trainer does
    datasets = hf_loaders(trainer, loaders, run.datasets, overridden)
    loaded = Run(config, datasets, run.optimizer, run.scheduler)
    optimizer, scheduler = optimizer_and_schedule(trainer, view, model, loaded, config)
    dialect = hf_parts.dialect(trainer.hf, hf_loss, trainer.compute_metrics)
    return Run(config, datasets, optimizer, scheduler, dialect), settings


def _loop_with_callbacks(
    trainer: Any,
    model: torch.nn.Module,
    run: Run,
    native: dict[str, Any],
    listener: Callable[[str, Any], None],
    kept_callbacks: list[Any] | None,
) -> Loop:
    """HF's callback list (``trainer.callback_handler``), and the loop that runs it."""
    session, args = trainer.hf, trainer.given["args"]
    if kept_callbacks is None:
        members, jit = callback_list(
            args, trainer.given["callbacks"], drives_loop=session.drives_loop
        )
    else:
        members = kept_callbacks
        jit = next((c for c in members if type(c).__name__ == "JITCheckpointCallback"), None)
    trainer.callback_handler = handler = CallbackHandler(members)
    session.trainer = trainer  # what HF callbacks get as ``trainer=``
    loop = build_loop(model, run, session, handler, native)
    handler.processing_class = trainer.processing_class
    handler.listener = listener  # each edit of the list after construction reaches the loop
    model_config = getattr(loop.model, "config", None)
    if session.drives_loop and model_config is not None:
        model_config.use_cache = hf_optim.arg(args, "use_cache", False)  # as HF's init
    if jit is not None:  # transformers' own callback: SIGTERM, then a save and a stop
        jit.set_trainer(trainer)
    return loop


# -- the constructor's arguments ----------------------------------------------------------
def check_preprocess(preprocess_logits_for_metrics: Any) -> None:
    if preprocess_logits_for_metrics is not None and not callable(preprocess_logits_for_metrics):
        raise TypeError(
            "preprocess_logits_for_metrics must be a function (logits, labels) -> logits, "
            f"got {type(preprocess_logits_for_metrics).__name__}"
        )


def call_model_init(init: Callable[..., Any] | None, trial: Any) -> torch.nn.Module:
    """``init()``, or ``init(trial)`` when it takes one argument."""
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


def model_to_train(
    model: torch.nn.Module | None, model_init: Any, call_model_init: Callable[[], Any]
) -> torch.nn.Module:
    """The model given, or ``model_init``'s (the exception types are transformers')."""
    if model is None:
        if model_init is None:
            raise RuntimeError("Trainer needs a model or a model_init (a function returning one)")
        return call_model_init()
    if model_init is not None:
        raise ValueError("give Trainer a model or a model_init, not both")
    return model


def check_given(given: Mapping[str, Any], native: Mapping[str, Any]) -> None:
    """Refuse constructor arguments transformers' Trainer would refuse, or that name the
    native trainer's keywords where HF's are meant."""
    compute_loss_func = given["compute_loss_func"]
    if compute_loss_func is not None and not callable(compute_loss_func):
        raise TypeError(
            "compute_loss_func must be a function (outputs, labels, num_items_in_batch=) "
            f"returning the loss, got {type(compute_loss_func).__name__}"
        )
    _check_optimizer_cls_and_kwargs(given["optimizer_cls_and_kwargs"], given["optimizers"])
    optimizers = given["optimizers"]
    if not (isinstance(optimizers, (tuple, list)) and len(optimizers) == 2):
        raise ValueError(
            "optimizers must be a pair (optimizer, lr_scheduler), either may be None; "
            f"got {optimizers!r}"
        )
    for key in ("train_data", "eval_data", "test_data", "callbacks", "scheduler", "dialect"):
        if key in native:
            raise TypeError(
                f"hookloop.compat.hf.Trainer takes HF's names: use {HF_NAMES[key]} instead of {key}"
            )
    compute_metrics = given["compute_metrics"]
    if compute_metrics is not None and not callable(compute_metrics):
        raise TypeError(
            "compute_metrics must be a function of an EvalPrediction returning a dict, "
            f"got {type(compute_metrics).__name__}"
        )


def _check_optimizer_cls_and_kwargs(cls_and_kwargs: Any, optimizers: Any) -> None:
    if cls_and_kwargs is None:
        return
    if optimizers[0] is not None:
        raise ValueError("give optimizers=(optimizer, ...) or optimizer_cls_and_kwargs, not both")
    if not (
        isinstance(cls_and_kwargs, (tuple, list))
        and len(cls_and_kwargs) == 2
        and isinstance(cls_and_kwargs[0], type)
        and isinstance(cls_and_kwargs[1], dict)
    ):
        raise TypeError(
            "optimizer_cls_and_kwargs must be (an optimizer class, a dict of its "
            f"keyword arguments), got {cls_and_kwargs!r}"
        )


# -- HF's step ------------------------------------------------------------------------------
def hf_step(
    trainer: Any,
    model: torch.nn.Module,
    args: Any,
    native: Mapping[str, Any],
    overridden: frozenset[str],
) -> HFLoss | None:
    """HF's step (``compute_loss``, ``num_items_in_batch``, ``EvalPrediction``) when the
    arguments decide the run and the model computes its own loss, with the trainer's
    override points wired in; None for a native step (``loss_fn`` or ``forward_step``),
    which refuses HF's per-batch arguments and overrides. Sets ``trainer.label_smoother``."""
    runs_hf_step = trainer.hf.drives_loop and native.get("loss_fn") is None
    if not runs_hf_step or native.get("forward_step") is not None:
        hf_only = {
            "compute_loss_func": trainer.compute_loss_func is not None,
            "preprocess_logits_for_metrics": trainer.preprocess_logits_for_metrics is not None,
            **{name: name in overridden for name in HF_STEP_OVERRIDES},
        }
        if any(hf_only.values()):
            raise ValueError(
                f"{', '.join(k for k, v in hf_only.items() if v)} apply {_HF_STEP_ONLY}"
            )
        return None
    hf_loss = HFLoss(model)
    trainer.label_smoother = label_smoother_for(args, model)
    if (
        "compute_loss" in overridden
        or trainer.compute_loss_func is not None
        or trainer.label_smoother is not None
    ):
        hf_loss.compute_loss = trainer.compute_loss  # HF's training_step calls it
    hf_loss.has_loss_func = trainer.compute_loss_func is not None
    hf_loss.group_size = int(hf_optim.arg(args, "gradient_accumulation_steps", 1))
    if "training_step" in overridden:
        hf_loss.training_step = trainer.training_step
    hf_loss.floating_point_ops = trainer.floating_point_ops
    hf_loss.scaled_for_ga = trainer.loss_is_scaled_for_ga
    return hf_loss


# -- what the arguments decide before the loop exists -------------------------------------
def run_config(args: Any, *, trains: bool) -> tuple[Config, dict[str, Any]]:
    """The Config that runs ``args`` and ``accelerator_config``'s settings, as HF's
    Trainer reads them (the accumulation steps as accelerate may set them on ``args``)."""
    settings = hf_accelerator.settings(getattr(args, "accelerator_config", None))
    steps = int(hf_optim.arg(args, "gradient_accumulation_steps", 1))
    if hf_accelerator.accumulation_steps(settings, steps) != steps:  # as transformers sets it
        args.gradient_accumulation_steps = hf_accelerator.accumulation_steps(settings, steps)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    hf_accelerator.check_reproduced(settings, world_size=world, trains=trains)
    arguments.refuse_ignored(args, arguments.honoured_fields(PlainSeq2SeqTrainingArguments))
    if is_dialect_args(args):  # the dialect's own classes refuse what it does not build
        check_training_fields(args)
    best = hf_optim.arg(args, "save_strategy", "steps") == "best"
    if (best or hf_optim.arg(args, "load_best_model_at_end", False)) and (
        hf_optim.arg(args, "metric_for_best_model", None) is None
    ):  # transformers' Trainer refuses it when built
        raise ValueError(
            "`args.metric_for_best_model` must be provided with save_strategy='best' or "
            "load_best_model_at_end=True (the evaluation metric that decides the best)"
        )
    config = arguments.args_config(args)
    if not config.train.log_every:
        # HF's logged loss (and train_loss) average every step since the last
        # log: the loss window keeps them all, and no step is a native log.
        config.train.log_every = NO_NATIVE_LOG
    # HF saves where the flags say and on_save clears should_save: at the save step.
    config.checkpoint.async_save = False
    if hf_optim.arg(args, "enable_jit_checkpoint", False):
        config.train.handle_signals = False  # SIGTERM is transformers' JIT callback's
    # HF applies a step whose loss or gradients are NaN/Inf (it only keeps such a loss
    # out of the logged mean, with logging_nan_inf_filter): no step is skipped.
    config.train.skip_nonfinite = False
    return config, settings


def hf_loaders(
    trainer: Any, loaders: hf_data.Loaders, datasets: list[Any], overridden: frozenset[str]
) -> list[Any]:
    """HF's loaders for the train, eval and test data; a subclass's loaders, as
    transformers asks for them (here once, when the loop is built; an evaluate() or
    predict() call asks again); a dict of evaluation datasets, each named set's."""
    loaded = [loaders.load(d, train=i == 0) for i, d in enumerate(datasets)]
    if "get_train_dataloader" in overridden and trainer.train_dataset is not None:
        loaded[0] = trainer.get_train_dataloader()
    if isinstance(trainer.eval_dataset, Mapping):  # named sets: each evaluated in turn
        loaders.eval_sets = {n: trainer.get_eval_dataloader(n) for n in trainer.eval_dataset}
        loaded[1] = next(iter(loaders.eval_sets.values()), None)
    elif "get_eval_dataloader" in overridden and trainer.eval_dataset is not None:
        loaded[1] = trainer.get_eval_dataloader(None)  # positionally, as transformers asks
    elif hf_optim.arg(trainer.args, "dataloader_persistent_workers", False):
        loaders.kept["eval"] = loaded[1]  # the one loader transformers keeps
    return loaded


def optimizer_and_schedule(
    trainer: Any, view: hf_optim.OptimizerView, model: torch.nn.Module, run: Run, config: Config
) -> tuple[torch.optim.Optimizer, Any]:
    """HF's ``create_optimizer`` and ``create_scheduler`` (a subclass's overrides
    included), called before the loop exists: ``trainer.model`` / ``optimizer`` /
    ``lr_scheduler`` are the staged ones meanwhile."""
    train_loader = run.datasets[0]
    with view.staging(model, run.optimizer, run.scheduler) as staged:
        if train_loader is not None:
            plan = hf_parts.plan_of(trainer.args, train_loader, config.train.grad_accum)
            trainer.create_optimizer()  # as transformers' train(): these two, in turn
            trainer.create_scheduler(num_training_steps=plan.max_steps)
        else:  # a trainer that only evaluates: no schedule
            trainer.create_optimizer()
        optimizer, scheduler = staged["optimizer"], staged["lr_scheduler"]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "create_optimizer must leave a torch.optim.Optimizer in self.optimizer, got "
            f"{type(optimizer).__name__}"
        )
    return optimizer, scheduler


# -- the callbacks and the loop -------------------------------------------------------------
def callback_list(args: Any, callbacks: Any, *, drives_loop: bool) -> tuple[list[Any], Any]:
    """The callbacks in HF's order (when the arguments decide the run: the flow, the
    reporters, transformers' JIT checkpoint callback, yours, the progress display), and
    the JIT checkpoint callback (None when off)."""
    members = as_list(callbacks)
    if not drives_loop:
        return members, None
    jit = jit_checkpoint(args)
    defaults = [DefaultFlowCallback(), *reporting.loggers(args), *([jit] if jit else [])]
    return [*defaults, *members, console.progress_callback(args)], jit


def build_loop(
    model: torch.nn.Module,
    run: Run,
    session: HFSession,
    handler: CallbackHandler,
    native: dict[str, Any],
) -> Loop:
    """The native loop, with HF's callbacks wrapped by the session; HF's handler then
    holds the loop's model, optimizer, schedule and loaders."""
    loop = Loop(
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
    handler.train_dataloader, handler.eval_dataloader = loop.train_loader, loop.eval_loader
    return loop


def connect_hooks(
    trainer: Any,
    loop: Loop,
    overridden: frozenset[str],
    *,
    preprocess_logits: Any,
    eval_sets: dict[str, Any],
) -> None:
    """Hand the loop's HF evaluation and log book the trainer's override points
    (``prediction_step``, ``evaluate``, ``log``); an override that only HF's parts can
    call is refused when the loop runs native ones."""
    evaluation, name = loop.evaluation, type(trainer).__name__
    if isinstance(evaluation, hf_parts.HFEvaluation):
        evaluation.prediction_step = trainer.prediction_step
        evaluation.preprocess_logits = preprocess_logits
        evaluation.eval_sets = eval_sets
        if "evaluate" in overridden:
            evaluation.evaluate_hook = trainer.evaluate
    elif "evaluate" in overridden:
        raise ValueError(f"{name}.evaluate applies {_HF_STEP_ONLY}")
    if "log" in overridden:
        if not isinstance(loop.logbook, hf_parts.HFLogBook):
            raise ValueError(
                f"{name}.log applies {_DECIDED_BY_ARGS} (args given, no hookloop config=)"
            )
        loop.logbook.log_hook = trainer.log
        if isinstance(evaluation, hf_parts.HFEvaluation):
            evaluation.log_hook = trainer.log


def jit_checkpoint(args: Any) -> Any:
    """transformers' ``JITCheckpointCallback`` for ``enable_jit_checkpoint`` (None when off)."""
    if not hf_optim.arg(args, "enable_jit_checkpoint", False):
        return None
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    return JITCheckpointCallback()
