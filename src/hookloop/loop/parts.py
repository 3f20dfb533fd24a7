"""What the loop is built from, built once: :func:`build_parts`.

The Trainer's constructor checks what it was given and calls :func:`build_parts`,
which places the model, opens the data, plans the budget, and builds each part with
exactly what it needs: the :class:`~hookloop.loop.stepper.Stepper`, the
:class:`~hookloop.loop.logbook.LogBook`, the
:class:`~hookloop.loop.evaluation.Evaluation`, the
:class:`~hookloop.checkpoint.checkpointer.Checkpointer` and the
:class:`~hookloop.loop.schedule.Schedule`. A :class:`Dialect` replaces any of them
(transformers' Trainer brings its own flow for the schedule, micro-step, log,
evaluation and checkpoint retention); each replacement is built from the same :class:`Parts` the
native one is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hookloop.checkpoint.checkpointer import Checkpointer
from hookloop.checkpoint.local import local_manager
from hookloop.checkpoint.manager import CheckpointManager
from hookloop.checkpoint.rewind import Rewinder
from hookloop.checkpoint.state import CallbackStates, DictState, RNGState
from hookloop.compile import check_can_compile, compile_loss, compile_module, unwrap_compiled
from hookloop.config import Config, TrainConfig
from hookloop.data import DataPosition, is_map_style, make_loader
from hookloop.distributed import parallelize, rank_info
from hookloop.errors import ConfigError
from hookloop.gcpolicy import GCPolicy
from hookloop.loop.evaluation import Evaluation
from hookloop.loop.live import LiveSettings
from hookloop.loop.logbook import LogBook
from hookloop.loop.schedule import NATIVE_FLOW, Flow, Schedule, StopSignals
from hookloop.loop.stepper import Clipping, MicroStep, Stepper
from hookloop.manager import CallbackManager
from hookloop.optim import build_optimizer, build_scheduler
from hookloop.precision import Precision
from hookloop.requests import Control
from hookloop.rundir import RunDir
from hookloop.state import CallbackContext, Progress, RunInfo, TrainState
from hookloop.step import bind_forward_step, default_forward_step
from hookloop.timers import LOOP_TIMERS, NULL_TIMER, Timers, loop_clock


@dataclass
class Inputs:
    """What the Trainer was given (checked), as :func:`build_parts` reads it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], Any] | None
    data: tuple[Any, Any, Any]  # train, eval, test (each may be None)
    config: Config
    callbacks: CallbackManager
    forward_step: Any
    loss_fn: Any
    scheduler: Any
    out_dir: str | None
    resume: str | None
    non_loss_data_func: Any
    collate_fn: Callable[[list[Any]], Any] | None = None


@dataclass
class Dialect:
    """The parts a dialect builds its own way; None keeps the native one. Each factory
    takes the :class:`Parts` built so far (plus whatever the dialect bound to it)."""

    plan_budget: Callable[[Parts], None] | None = None
    micro_step: Callable[[Parts], MicroStep] | None = None
    clipping: Callable[[Parts], Clipping] | None = None
    logbook: Callable[[Parts], LogBook] | None = None
    evaluation: Callable[[Parts], Evaluation] | None = None
    checkpoints: Callable[[Parts, Path, bool], CheckpointManager] | None = None
    #: The decisions the dialect's flow makes differently (the native Schedule takes it).
    flow: Callable[[Parts], Flow] | None = None
    live: Callable[[Parts], LiveSettings] | None = None
    #: A save asked for at a step already saved announces that checkpoint again.
    announce_repeated_saves: bool = False
    #: The dialect steps a metric-driven LR scheduler (``ReduceLROnPlateau``) after its
    #: evaluations itself; the native loop refuses one (it has no metric per step).
    steps_metric_scheduler: bool = False


@dataclass
class Loaders:
    """The run's data: batches to train on, to evaluate on, to test on (any may be None)."""

    train: Iterable[Any] | None
    eval: Iterable[Any] | None
    test: Iterable[Any] | None


@dataclass
class Parts:
    """Everything the loop runs with (see the module doc)."""

    config: Config
    callbacks: CallbackManager
    progress: Progress
    state: TrainState
    control: Control
    device: torch.device
    model: torch.nn.Module  # as the user gave it (never wrapped)
    train_model: Any  # what the step runs: DDP-wrapped, FSDP2-sharded or compiled
    optimizer: torch.optim.Optimizer
    loaders: Loaders
    open_loader: Callable[[Iterable[Any] | None, bool], Iterable[Any] | None]
    out_dir: str | None
    resume: str | None
    forward: Callable[..., Any] = None  # type: ignore[assignment]  # set by build_parts
    scheduler: Any = None
    precision: Precision = None  # type: ignore[assignment]  # set by build_parts
    position: DataPosition = None  # type: ignore[assignment]  # set by build_parts
    rewinder: Rewinder = None  # type: ignore[assignment]  # set by build_parts
    ctx: CallbackContext = None  # type: ignore[assignment]  # set by build_parts
    fire: Callable[[str], None] = None  # type: ignore[assignment]  # set by build_parts
    clock: Callable[[], float] = None  # type: ignore[assignment]  # set by build_parts
    timers: dict[str, Any] = field(default_factory=dict)
    signals: StopSignals = field(default_factory=StopSignals)
    gc: GCPolicy = None  # type: ignore[assignment]  # set by build_parts
    logbook: LogBook = None  # type: ignore[assignment]  # set by build_parts
    evaluation: Evaluation = None  # type: ignore[assignment]  # set by build_parts
    stepper: Stepper = None  # type: ignore[assignment]  # set by build_parts
    checkpointer: Checkpointer = None  # type: ignore[assignment]  # set by build_parts
    schedule: Schedule = None  # type: ignore[assignment]  # set by build_parts
    live: LiveSettings = None  # type: ignore[assignment]  # set by build_parts
    dialect: Dialect = field(default_factory=Dialect)


def build_parts(given: Inputs, dialect: Dialect | None = None) -> Parts:
    """Place the model, open the data, plan the budget and build every part, once."""
    native = dialect is None
    dialect = dialect or Dialect()
    config, callbacks = given.config, given.callbacks
    progress = Progress()
    progress.rank, progress.local_rank, progress.world_size = rank_info()
    device = resolve_device(config.train.device, progress.local_rank)
    model, train_model, optimizer = place_model(given.model, given.optimizer, config, device)
    open_loader = functools.partial(
        _open_loader, config=config, progress=progress, collate_fn=given.collate_fn
    )
    p = Parts(
        config=config,
        callbacks=callbacks,
        progress=progress,
        state=TrainState(progress),
        control=Control(),
        device=device,
        model=model,
        train_model=train_model,
        optimizer=optimizer,
        loaders=Loaders(
            open_loader(given.data[0], True),
            open_loader(given.data[1], False),
            open_loader(given.data[2], False),
        ),
        open_loader=open_loader,
        out_dir=given.out_dir,
        resume=given.resume,
        dialect=dialect,
    )
    (dialect.plan_budget or plan_budget)(p)
    k = config.train.grad_accum
    # A dialect's data comes as its original's does; the native loop refuses rows.
    p.position = DataPosition(
        p.loaders.train if p.loaders.train is not None else (), k, check_rows=native
    )
    p.scheduler = make_scheduler(given.scheduler, config, optimizer, progress.max_steps)
    loss_fn = compile_loss(given.loss_fn) if config.train.compile else given.loss_fn
    p.forward = bind_forward_step(given.forward_step or default_forward_step(loss_fn, device))
    p.precision = Precision(config.train.precision, device)
    p.rewinder = Rewinder(progress, k)
    persistent, local = checkpoint_managers(p, given.out_dir, given.resume)
    p.ctx = _context(p, given, can_checkpoint=persistent is not None)
    p.fire = _firer(p.callbacks, p.ctx)
    _start_timers(p)
    p.gc = GCPolicy(config.train.gc_every, around_eval=config.train.gc_eval)
    p.logbook = (dialect.logbook or _logbook)(p)
    p.evaluation = (dialect.evaluation or _evaluation)(p)
    p.evaluation.non_loss_data_func = given.non_loss_data_func
    p.stepper = _stepper(p)
    p.checkpointer = _checkpointer(p, persistent, local)
    p.schedule = _schedule(p)
    p.live = p.ctx.settings = (dialect.live or _live)(p)
    return p


# -- the model and the data -------------------------------------------------------------


def place_model(
    model: torch.nn.Module, optimizer: Any, config: Config, device: torch.device
) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
    """``(model, what the step runs, optimizer)``: the model on its device as users and
    callbacks see it (never wrapped, but sharded in place under fsdp, its parameters
    then DTensors); DDP-wrapped, FSDP2-sharded or compiled for the step. Sharding
    replaces the parameters, so an optimizer from the config, or from a function of the
    model given as ``optimizer``, is built afterwards. A model given compiled is
    unwrapped (:mod:`hookloop.compile`)."""
    cfg = config.train
    model, compiled = unwrap_compiled(model)
    model = model.to(device)
    train_model = parallelize(model, cfg.parallel, device, optimizer)
    if cfg.compile or compiled is not None:
        if cfg.compile:
            check_can_compile(device)
        if compiled is not None and train_model is model:  # not wrapped: the user's own
            train_model = compiled
        else:
            train_model = compile_module(train_model)
    if optimizer is None:
        optimizer = build_optimizer(config.optimizer, model)
    elif not isinstance(optimizer, torch.optim.Optimizer):  # a factory, given the model
        optimizer = _made(optimizer(model), torch.optim.Optimizer, "optimizer")
    return model, train_model, optimizer


def _made(made: Any, cls: type, what: str) -> Any:
    if not isinstance(made, cls):
        raise TypeError(
            f"the {what} function must return a {cls.__module__}.{cls.__name__}, got "
            f"{type(made).__name__}"
        )
    return made


def make_scheduler(scheduler: Any, config: Config, optimizer: Any, total_steps: Any) -> Any:
    """The given scheduler; one a function makes from the optimizer (a value with no
    ``step`` method is such a function); or the config's (None: a constant rate)."""
    if scheduler is None:
        return build_scheduler(config.scheduler, optimizer, total_steps)
    if callable(scheduler) and not hasattr(scheduler, "step"):
        made = scheduler(optimizer)
        if not callable(getattr(made, "step", None)):
            raise TypeError(
                f"the scheduler function must return a scheduler (with step()), got "
                f"{type(made).__name__}"
            )
        return made
    return scheduler


def _open_loader(
    data: Iterable[Any] | None,
    train: bool,
    *,
    config: Config,
    progress: Progress,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Iterable[Any] | None:
    """A dataset (any sized indexable but a list or tuple, :mod:`hookloop.data`) wrapped
    in a resumable, seeded loader; loaders and other iterables of batches as they are."""
    if data is None:
        return None
    if isinstance(data, (Mapping, torch.Tensor)) or not isinstance(data, Iterable | Sized):
        raise TypeError(
            f"{'train' if train else 'eval/test'} data must be a dataset (an object with "
            "__getitem__ and __len__, e.g. a torch Dataset or a datasets.Dataset), a "
            f"DataLoader or an iterable of batches, got {type(data).__name__}"
        )
    if is_map_style(data):
        dc = config.data
        return make_loader(
            data,
            batch_size=dc.batch_size if train else (dc.eval_batch_size or dc.batch_size),
            shuffle=dc.shuffle and train,
            seed=config.seed,
            rank=progress.rank,
            world_size=progress.world_size,
            num_workers=dc.num_workers,
            drop_last=train,
            collate_fn=collate_fn,
        )
    if collate_fn is not None:
        raise ValueError(
            f"collate_fn applies to a dataset hookloop batches, but the "
            f"{'train' if train else 'eval/test'} data is a {type(data).__name__} of "
            "batches: give the collate_fn to its DataLoader instead"
        )
    return data


def plan_budget(p: Parts) -> None:
    """The native budget: steps per epoch, and the step and epoch budget of
    ``train.max_steps`` / ``max_epochs`` over the train data (a stream: max_steps)."""
    cfg, st = p.config.train, p.progress
    batches = batch_count(p.loaders.train, None)
    st.steps_per_epoch = batches // cfg.grad_accum if batches is not None else None
    if st.steps_per_epoch == 0:
        raise ConfigError(
            f"train data has {batches} batches per epoch, fewer than "
            f"train.grad_accum={cfg.grad_accum}: no optimizer step fits in an epoch"
        )
    st.num_epochs = cfg.max_epochs or (None if cfg.max_steps else 1)
    st.max_steps = cfg.max_steps
    if st.max_steps is None and st.steps_per_epoch is not None and st.num_epochs is not None:
        st.max_steps = st.num_epochs * st.steps_per_epoch


def batch_count(loader: Iterable[Any] | None, limit: int | None) -> int | None:
    """Batches one pass over ``loader`` runs, when its length is known."""
    if not isinstance(loader, Sized):
        return None
    try:
        n = len(loader)
    except TypeError:  # a DataLoader over an IterableDataset
        return None
    return min(n, limit) if limit else n


# -- the parts ----------------------------------------------------------------------------


def _context(p: Parts, given: Inputs, *, can_checkpoint: bool) -> CallbackContext:
    """The one object every handler receives."""
    limit = p.config.train.eval_max_batches
    return CallbackContext(
        trainer=None,
        state=p.state,
        control=p.control,
        run=RunInfo(
            dir=RunDir(given.out_dir) if given.out_dir is not None else None,
            device=p.device,
            resume=given.resume,
            can_checkpoint=can_checkpoint,
            has_eval_data=p.loaders.eval is not None,
            has_test_data=p.loaders.test is not None,
            eval_batches=batch_count(p.loaders.eval, limit),
            test_batches=batch_count(p.loaders.test, limit),
        ),
        model=p.model,
        optimizer=p.optimizer,
        scheduler=p.scheduler,
        config=p.config,
        user_state=p.callbacks.user_state,
    )


def _firer(callbacks: CallbackManager, ctx: CallbackContext) -> Callable[[str], None]:
    """``fire(event)``: the event's handlers with ``ctx``, when it has any."""
    hooks = callbacks.index  # live: it follows callbacks added and removed

    def fire(event: str) -> None:
        if hooks[event]:
            callbacks.fire(event, ctx)

    return fire


def _start_timers(p: Parts) -> None:
    """``state.timers`` for everyone; the loop's own timers, or no-ops when off, and the
    clock the loop reads once per step boundary (``train.timers``)."""
    mode = p.config.train.timers
    p.progress.timers = Timers(sync=mode == "sync", device=p.device)
    p.clock = loop_clock(mode, p.device)
    for name in LOOP_TIMERS:  # data-iterator, forward-backward, optimizer, eval, checkpoint-save
        p.timers[name] = NULL_TIMER if mode == "off" else p.progress.timers(name)


def checkpoint_managers(
    p: Parts, out_dir: str | None, resume: str | None
) -> tuple[CheckpointManager | None, CheckpointManager | None]:
    """The run's persistent and local checkpoint managers (None, None without ``out_dir``
    and ``resume``). Resuming from a path without out_dir: the run it belongs to goes on
    saving there."""
    if out_dir is None and resume is None:
        return None, None
    run = RunDir(out_dir) if out_dir else RunDir.of_checkpoint(str(resume))
    resuming = resume is not None
    if p.dialect.checkpoints is not None:
        persistent = p.dialect.checkpoints(p, run.checkpoints, resuming)
    else:
        persistent = CheckpointManager.from_config(
            p.config.checkpoint, run.checkpoints, resuming=resuming
        )
    local = local_manager(p.config.checkpoint, RunDir.of_checkpoint(persistent.storage.root),
                          resuming=resuming)  # fmt: skip
    return persistent, local


def named_state(p: Parts) -> dict[str, Any]:
    """Everything a checkpoint holds, by name (the names are the file format).

    Loaded in this order: the RNG last, so nothing restored after it draws.
    """
    state: dict[str, Any] = {"model": p.model, "optimizer": p.optimizer}
    if p.scheduler is not None:
        state["scheduler"] = p.scheduler
    persistent = p.checkpointer.persistent
    strict = persistent.strict if persistent is not None else False
    state |= {
        "train_state": p.state,
        "scaler": p.precision,
        "user_state": DictState(p.callbacks.user_state),
        "callbacks": CallbackStates(p.callbacks.stateful_callbacks(), strict=strict),
        "data": p.position,
        "log_pending": p.logbook.window,
        "rewind": p.rewinder,
        "settings": p.live,
        "rng": RNGState(),
    }
    return state


def _logbook(p: Parts) -> LogBook:
    return LogBook(
        progress=p.progress,
        optimizer=p.optimizer,
        config=p.config.train,
        device=p.device,
        ctx=p.ctx,
        hooks=p.callbacks.index,
        fire=p.callbacks.fire,
    )


def evaluation_inputs(p: Parts) -> dict[str, Any]:
    """What an :class:`Evaluation` is built with (a dialect's subclass too)."""
    return dict(
        model=p.model,
        forward=p.forward,
        precision=p.precision,
        state=p.state,
        progress=p.progress,
        ctx=p.ctx,
        hooks=p.callbacks.index,
        fire=p.callbacks.fire,
        max_batches=p.config.train.eval_max_batches,
        device=p.device,
    )


def _evaluation(p: Parts) -> Evaluation:
    return Evaluation(**evaluation_inputs(p))


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


def _stepper(p: Parts) -> Stepper:
    cfg, dialect = p.config.train, p.dialect
    micro_step = (
        dialect.micro_step(p)
        if dialect.micro_step is not None
        else MicroStep(p.forward, p.state, p.precision)
    )
    clipping = dialect.clipping(p) if dialect.clipping is not None else Clipping(cfg.clip_grad_norm)
    on_metric = steps_on_a_metric(p.scheduler)
    if on_metric and not dialect.steps_metric_scheduler:
        raise ValueError(
            f"a {type(p.scheduler).__name__} scheduler steps on a metric, not once a step: pass "
            "scheduler=None and step it in a callback's on_eval_end "
            "(ctx.scheduler is None then; keep your own reference)"
        )
    return Stepper(
        model=p.model,
        train_model=p.train_model,
        optimizer=p.optimizer,
        scheduler=p.scheduler,
        precision=p.precision,
        micro_step=micro_step,
        clipping=clipping,
        progress=p.progress,
        control=p.control,
        ctx=p.ctx,
        hooks=p.callbacks.index,
        fire=p.callbacks.fire,
        rewinder=p.rewinder,
        config=cfg,
        device=p.device,
        timers=(p.timers["forward-backward"], p.timers["optimizer"]),
        clock=p.clock,
        steps_scheduler=not on_metric,
    )


def _checkpointer(
    p: Parts, persistent: CheckpointManager | None, local: CheckpointManager | None
) -> Checkpointer:
    return Checkpointer(
        persistent,
        local,
        named_state=functools.partial(named_state, p),
        ctx=p.ctx,
        fire=p.fire,
        progress=p.progress,
        rewinder=p.rewinder,
        log=p.logbook,
        config=p.config,
        model=p.model,
        timer=p.timers["checkpoint-save"],
        announce_repeats=p.dialect.announce_repeated_saves,
    )


def live_inputs(p: Parts) -> dict[str, Any]:
    """What :class:`LiveSettings` is built with (a dialect's subclass too)."""
    return dict(
        optimizer=p.optimizer,
        scheduler=p.scheduler,
        config=p.config,
        clipping=p.stepper.clipping,
        checkpointer=p.checkpointer,
        callbacks=p.callbacks,
        control=p.control,
        progress=p.progress,
        run_dir=p.ctx.run.dir
        or (
            p.checkpointer.persistent
            and RunDir.of_checkpoint(p.checkpointer.persistent.storage.root)
        ),
        has_eval=p.loaders.eval is not None,
    )


def _live(p: Parts) -> LiveSettings:
    return LiveSettings(**live_inputs(p))


def _schedule(p: Parts) -> Schedule:
    """The one schedule, with the dialect's :class:`~hookloop.loop.schedule.Flow` if any."""
    return Schedule(
        config=p.config.train,
        progress=p.progress,
        control=p.control,
        signals=p.signals,
        device=p.device,
        has_eval=p.loaders.eval is not None,
        checkpointer=p.checkpointer,
        flow=NATIVE_FLOW if p.dialect.flow is None else p.dialect.flow(p),
    )


# -- checking what the Trainer was given ------------------------------------------------


def check_inputs(
    model: Any, optimizer: Any, forward_step: Any, loss_fn: Any, non_loss_data_func: Any
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not (
        isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)
    ):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a function of the model that makes "
            f"one, or None, got {type(optimizer).__name__}"
        )
    if forward_step is not None and loss_fn is not None:
        raise ValueError("give forward_step or loss_fn, not both (loss_fn is for the default step)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(outputs, targets), got {loss_fn!r}")
    if non_loss_data_func is not None and not callable(non_loss_data_func):
        raise TypeError(f"non_loss_data_func must be callable(model), got {non_loss_data_func!r}")


def check_flops(value: Any) -> float | None:
    """A FLOPs-per-sample figure must be a finite number > 0 (or None: no estimate)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e300:
        raise ValueError(
            f"flops_per_sample must be a finite number > 0 or None (no estimate), got {value!r}"
        )
    return float(value)


def as_config(config: Config | TrainConfig | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, TrainConfig):
        return Config(train=config)
    raise TypeError(
        f"config must be a hookloop Config or TrainConfig (or None), got {type(config).__name__}"
    )


def as_manager(callbacks: Any) -> CallbackManager:
    if callbacks is None:
        return CallbackManager()
    if isinstance(callbacks, CallbackManager):
        return callbacks
    return CallbackManager(callbacks)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"  # one GPU per process under torchrun
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available; use 'cpu' or 'auto'")
    return device
