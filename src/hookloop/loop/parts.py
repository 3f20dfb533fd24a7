"""What the loop is built from, built once: :func:`build_parts`.

The Trainer's constructor checks what it was given and calls :func:`build_parts`,
which places the model, opens the data, plans the budget, and builds each part with
exactly what it needs, in order: the :class:`~hookloop.loop.stepper.Stepper`, the
:class:`~hookloop.loop.logbook.LogBook`, the
:class:`~hookloop.loop.evaluation.Evaluation`, the
:class:`~hookloop.loop.live.LiveSettings` and the
:class:`~hookloop.checkpoint.checkpointer.Checkpointer` (given the
:class:`~hookloop.loop.contents.CheckpointContents`, the states a checkpoint names).
What several parts share travels as one record of :mod:`hookloop.loop.records` (the
event channel, the trained objects, how a batch is computed, the timing). The
:class:`Parts` record is made once they are all built; the
:class:`~hookloop.loop.schedule.Schedule` is built last, from it.

A :class:`Dialect` replaces any of them (transformers' Trainer brings its own
flow for the schedule, micro-step, log, evaluation and checkpoint retention); each
factory is given what the native part is built from.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hookloop.activation_checkpointing import checkpoint_by_name
from hookloop.checkpoint.checkpointer import Checkpointer, CheckpointStores
from hookloop.checkpoint.local import local_manager
from hookloop.checkpoint.manager import CheckpointManager
from hookloop.checkpoint.rewind import Rewinder
from hookloop.compile import check_can_compile, compile_loss, compile_module, unwrap_compiled
from hookloop.config import CheckpointConfig, Config, TrainConfig
from hookloop.data import DataPosition, EpochSampler, is_map_style, make_loader
from hookloop.distributed import parallelize, rank_info
from hookloop.errors import ConfigError
from hookloop.gcpolicy import GCPolicy
from hookloop.loop.auto_batch import fit_batch_size
from hookloop.loop.contents import CheckpointContents
from hookloop.loop.evaluation import Evaluation
from hookloop.loop.inputs import Inputs
from hookloop.loop.live import LiveSettings
from hookloop.loop.logbook import LogBook
from hookloop.loop.records import Compute, Events, LoopTiming, Trained
from hookloop.loop.schedule import NATIVE_FLOW, Flow, Schedule, StopSignals
from hookloop.loop.stepper import Clipping, MicroStep, Stepper, UpdateRules, steps_on_a_metric
from hookloop.manager import CallbackManager
from hookloop.optim import build_optimizer, build_scheduler
from hookloop.precision import Precision
from hookloop.requests import Control
from hookloop.rundir import RunDir
from hookloop.state import CallbackContext, Progress, RunInfo, TrainState
from hookloop.step import bind_forward_step, default_forward_step
from hookloop.timers import LOOP_TIMERS, NULL_TIMER, Timers, loop_clock
from hookloop.watchdog import Watchdog


@dataclass
class Dialect:
    """The parts a dialect builds its own way; None keeps the native one. Each factory
    is given what that part is built from (plus whatever the dialect bound to it):

    - ``plan_budget(train_data, train_config, progress)`` sets the step and epoch budget;
    - ``micro_step(compute, progress)``, ``clipping()``: the step's loss and its norm;
    - ``logbook(stepper, events, progress, train_config)``: the log (the stepper tells
      the rate the last update used);
    - ``evaluation(trained, compute, events, progress, max_batches)``;
    - ``checkpoints(checkpoint_config, root, resuming)``: the persistent manager;
    - ``flow(parts)``: the decisions the dialect's flow makes differently, which the
      native Schedule takes (from the parts built);
    - ``live(settings)``: the native live settings, with the dialect's own keys.
    """

    plan_budget: Callable[[Iterable[Any] | None, TrainConfig, Progress], None] | None = None
    micro_step: Callable[[Compute, Progress], MicroStep] | None = None
    clipping: Callable[[], Clipping] | None = None
    logbook: Callable[[Stepper, Events, Progress, TrainConfig], LogBook] | None = None
    evaluation: Callable[[Trained, Compute, Events, Progress, int | None], Evaluation] | None = None
    checkpoints: Callable[[CheckpointConfig, Path, bool], CheckpointManager] | None = None
    flow: Callable[[Parts], Flow] | None = None
    live: Callable[[LiveSettings], LiveSettings] | None = None
    #: The signals the loop catches to finish the step, save and exit (None: SIGTERM
    #: and SIGINT; Megatron-Bridge's ``train.exit_signal`` alone).
    stop_signals: tuple[int, ...] | None = None
    #: A save asked for at a step already saved announces that checkpoint again.
    announce_repeated_saves: bool = False
    #: The dialect steps a metric-driven LR scheduler (``ReduceLROnPlateau``) after its
    #: evaluations itself; the native loop refuses one (it has no metric per step).
    steps_metric_scheduler: bool = False
    #: Each training batch is fetched before the one ahead of it is trained on, as
    #: transformers' loader (accelerate's) does: a collator that draws random numbers
    #: (masks) then draws them in its order, relative to dropout and evaluations.
    fetch_ahead: bool = False
    #: A resume restores the generators only once the first step's batches of the resumed
    #: epoch are fetched (at its start, when it resumes on an epoch's first step), as
    #: transformers' Trainer does: the batches fetched then draw from the generators as
    #: they were before the restore.
    rng_after_first_fetch: bool = False


@dataclass(frozen=True)
class Loaders:
    """The run's data: batches to train on, to evaluate on, to test on (any may be None)."""

    train: Iterable[Any] | None
    eval: Iterable[Any] | None
    test: Iterable[Any] | None


@dataclass(frozen=True)
class Parts:
    """What the loop runs with, each part built before the record is (see the module
    doc): the run's records (:mod:`hookloop.loop.records`), its data and bookkeeping,
    and the parts. The schedule is built last, from this record."""

    config: Config
    callbacks: CallbackManager
    progress: Progress
    trained: Trained
    compute: Compute
    events: Events
    timing: LoopTiming
    loaders: Loaders
    open_loader: Callable[[Iterable[Any] | None, bool], Iterable[Any] | None]
    out_dir: str | None
    resume: str | None
    position: DataPosition
    rewinder: Rewinder
    signals: StopSignals
    gc: GCPolicy
    stepper: Stepper
    logbook: LogBook
    evaluation: Evaluation
    checkpointer: Checkpointer
    live: LiveSettings
    dialect: Dialect
    #: Names a rank that hangs while training runs on several ranks (hookloop.watchdog).
    watchdog: Watchdog

    # What the loop and the schedule read, by the names they read it.
    @property
    def model(self) -> torch.nn.Module:
        return self.trained.model

    @property
    def train_model(self) -> Any:
        return self.trained.train_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trained.optimizer

    @property
    def scheduler(self) -> Any:
        return self.trained.scheduler

    @property
    def device(self) -> torch.device:
        return self.compute.device

    @property
    def precision(self) -> Precision:
        return self.compute.precision

    @property
    def ctx(self) -> CallbackContext:
        return self.events.ctx

    @property
    def state(self) -> TrainState:
        return self.events.ctx.state

    @property
    def control(self) -> Control:
        return self.events.ctx.control

    @property
    def fire(self) -> Callable[[str], None]:
        """``fire(event)``: the event's handlers with ``ctx``, when it has any."""
        return self.events.emit

    @property
    def clock(self) -> Callable[[], float]:
        return self.timing.clock

    @property
    def timers(self) -> Mapping[str, Any]:
        return self.timing.timers


def build_parts(given: Inputs, dialect: Dialect | None = None) -> tuple[Parts, Schedule]:
    """Place the model, open the data, plan the budget and build every part, once; then
    the schedule over them."""
    native = dialect is None
    dialect = dialect or Dialect()
    config, callbacks, cfg = given.config, given.callbacks, given.config.train
    progress = Progress()
    progress.place(*rank_info())
    device = resolve_device(cfg.device, progress.local_rank)
    model, train_model, optimizer = place_model(given.model, given.optimizer, config, device)
    compute = _compute(given, progress, device)
    fit_batch_size(config, model, given.data[0], compute, progress.world_size, given.collate_fn)
    open_loader = functools.partial(
        _open_loader, config=config, progress=progress, collate_fn=given.collate_fn
    )
    loaders = Loaders(*(open_loader(data, i == 0) for i, data in enumerate(given.data)))
    (dialect.plan_budget or plan_budget)(loaders.train, cfg, progress)
    position = _train_position(loaders.train, config, callbacks, native, progress, given)
    scheduler = make_scheduler(given.scheduler, config, optimizer, progress.max_steps)
    trained = Trained(model, train_model, optimizer, scheduler)
    stores = checkpoint_managers(config, dialect, given.out_dir, given.resume)
    ctx = _context(given, trained, compute, loaders, stores)
    events = Events(ctx, callbacks.index, callbacks.fire)  # the index is live
    timing = start_timers(cfg.timers, progress, device)
    rewinder = Rewinder(progress, cfg.grad_accum)
    stepper = _stepper(trained, compute, events, progress, rewinder, timing, config, dialect)
    logbook = (dialect.logbook or native_logbook)(stepper, events, progress, cfg)
    evaluation = (dialect.evaluation or native_evaluation)(
        trained, compute, events, progress, cfg.eval_max_batches
    )
    evaluation.non_loss_data_func = given.non_loss_data_func
    live = _live(trained, config, stepper.clipping, stores, callbacks, ctx, progress, dialect)
    ctx.settings = live
    contents = CheckpointContents(
        trained, ctx.state, compute.precision, callbacks, position, logbook.window, rewinder, live
    )
    checkpointer = Checkpointer(
        stores,
        contents=contents,
        config=config,
        events=events,
        progress=progress,
        log=logbook,
        timer=timing.timers["checkpoint-save"],
        announce_repeats=dialect.announce_repeated_saves,
    )
    parts = Parts(
        config, callbacks, progress, trained, compute, events, timing,
        loaders, open_loader, given.out_dir, given.resume, position, rewinder,
        StopSignals(dialect.stop_signals or (signal.SIGTERM, signal.SIGINT)),
        GCPolicy(cfg.gc_every, around_eval=cfg.gc_eval),
        stepper, logbook, evaluation, checkpointer, live, dialect,
        Watchdog(progress, cfg.watchdog_seconds, ctx.run.dir),
    )  # fmt: skip
    return parts, _schedule(parts)


def _train_position(
    train: Any, config: Config, callbacks: Any, native: bool, progress: Progress, given: Inputs
) -> DataPosition:
    """Where the training data stands (a dialect's data comes as its original's does; the
    native loop refuses rows), with the sample ledger when ``data.ledger`` asks."""
    position = DataPosition(
        train if train is not None else (), config.train.grad_accum, check_rows=native,
        world_size=progress.world_size,
    )  # fmt: skip
    if config.data.ledger:
        _add_ledger(callbacks, position, given.out_dir)
    return position


def _add_ledger(callbacks: CallbackManager, position: DataPosition, out_dir: str | None) -> None:
    """``data.ledger``: a :class:`~hookloop.ledger.SampleLedger` over the sampler hookloop
    deals the train data with; refused by name where there is none or no run directory."""
    from hookloop.ledger import SampleLedger

    sampler = position.sampler
    if out_dir is None or not isinstance(sampler, EpochSampler):
        what = (
            "no out_dir" if out_dir is None else f"train data dealt by a {type(sampler).__name__}"
        )
        raise ConfigError(
            f"data.ledger needs a run directory and a dataset hookloop deals (an object "
            f"with __getitem__ and __len__); this run has {what}"
        )
    batch = getattr(position.loader, "batch_size", None) or 1
    callbacks.add(SampleLedger(sampler, RunDir(out_dir).root, batch))


def _compute(given: Inputs, progress: Progress, device: torch.device) -> Compute:
    """How the run computes a batch: the forward step (the default one with the loss
    function, compiled when ``train.compile``), in ``train.precision``."""
    cfg = given.config.train
    loss_fn = compile_loss(given.loss_fn) if cfg.compile else given.loss_fn
    forward = bind_forward_step(given.forward_step or default_forward_step(loss_fn, device))
    return Compute(forward, TrainState(progress), Precision(cfg.precision, device), device)


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
    if cfg.activation_checkpointing:
        checkpoint_by_name(model, cfg.activation_checkpointing)  # before DDP / FSDP wrap it
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
            batch_size=int(dc.batch_size if train else (dc.eval_batch_size or dc.batch_size)),
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


def plan_budget(train: Iterable[Any] | None, config: TrainConfig, progress: Progress) -> None:
    """The native budget: steps per epoch, and the step and epoch budget of
    ``train.max_steps`` / ``max_epochs`` over the train data (a stream: max_steps)."""
    batches = batch_count(train, None)
    steps_per_epoch = batches // config.grad_accum if batches is not None else None
    if steps_per_epoch == 0:
        raise ConfigError(
            f"train data has {batches} batches per epoch, fewer than "
            f"train.grad_accum={config.grad_accum}: no optimizer step fits in an epoch"
        )
    num_epochs = config.max_epochs or (None if config.max_steps else 1)
    max_steps = config.max_steps
    if max_steps is None and steps_per_epoch is not None and num_epochs is not None:
        max_steps = num_epochs * steps_per_epoch
    progress.plan(steps_per_epoch, num_epochs, max_steps)


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


def _context(
    given: Inputs, trained: Trained, compute: Compute, loaders: Loaders, stores: CheckpointStores
) -> CallbackContext:
    """The one object every handler receives."""
    limit = given.config.train.eval_max_batches
    return CallbackContext(
        trainer=None,
        state=compute.state,
        control=Control(),
        run=RunInfo(
            dir=RunDir(given.out_dir) if given.out_dir is not None else None,
            device=compute.device,
            resume=given.resume,
            can_checkpoint=stores.persistent is not None,
            has_eval_data=loaders.eval is not None,
            has_test_data=loaders.test is not None,
            eval_batches=batch_count(loaders.eval, limit),
            test_batches=batch_count(loaders.test, limit),
        ),
        model=trained.model,
        optimizer=trained.optimizer,
        scheduler=trained.scheduler,
        config=given.config,
        user_state=given.callbacks.user_state,
    )


def start_timers(mode: str, progress: Progress, device: torch.device) -> LoopTiming:
    """``state.timers`` for everyone; the loop's own timers, or no-ops when off, and the
    clock the loop reads once per step boundary (``train.timers``)."""
    progress.use_timers(Timers(sync=mode == "sync", device=device))
    # data-iterator, forward-backward, optimizer, eval, checkpoint-save
    timers = {name: NULL_TIMER if mode == "off" else progress.timers(name) for name in LOOP_TIMERS}
    return LoopTiming(loop_clock(mode, device), timers)


def checkpoint_managers(
    config: Config, dialect: Dialect, out_dir: str | None, resume: str | None
) -> CheckpointStores:
    """The run's persistent and local checkpoint managers (None, None without ``out_dir``
    and ``resume``). Resuming from a path without out_dir: the run it belongs to goes on
    saving there."""
    if out_dir is None and resume is None:
        return CheckpointStores(None, None)
    run = RunDir(out_dir) if out_dir else RunDir.of_checkpoint(str(resume))
    resuming = resume is not None
    if dialect.checkpoints is not None:
        persistent = dialect.checkpoints(config.checkpoint, run.checkpoints, resuming)
    else:
        persistent = CheckpointManager.from_config(
            config.checkpoint, run.checkpoints, resuming=resuming
        )
    local = local_manager(config.checkpoint, RunDir.of_checkpoint(persistent.storage.root),
                          resuming=resuming)  # fmt: skip
    return CheckpointStores(persistent, local)


def _stepper(
    trained: Trained,
    compute: Compute,
    events: Events,
    progress: Progress,
    rewinder: Rewinder,
    timing: LoopTiming,
    config: Config,
    dialect: Dialect,
) -> Stepper:
    cfg = config.train
    micro_step = (
        dialect.micro_step(compute, progress)
        if dialect.micro_step is not None
        else MicroStep(compute.forward, compute.state, compute.precision)
    )
    clipping = dialect.clipping() if dialect.clipping is not None else Clipping(cfg.clip_grad_norm)
    scheduler = trained.scheduler
    if steps_on_a_metric(scheduler) and not dialect.steps_metric_scheduler:
        raise ValueError(
            f"a {type(scheduler).__name__} scheduler steps on a metric, not once a step: pass "
            "scheduler=None and step it in a callback's on_eval_end "
            "(ctx.scheduler is None then; keep your own reference)"
        )
    return Stepper(
        trained=trained,
        compute=compute,
        micro_step=micro_step,
        rules=UpdateRules(clipping, cfg),
        events=events,
        progress=progress,
        rewinder=rewinder,
        timing=timing,
    )


def native_logbook(
    stepper: Stepper, events: Events, progress: Progress, config: TrainConfig
) -> LogBook:
    """The native log of a run stepped by ``stepper`` (its optimizer's rate, its device)."""
    return LogBook(
        progress=progress,
        optimizer=stepper.optimizer,
        config=config,
        device=stepper.device,
        events=events,
    )


def native_evaluation(
    trained: Trained,
    compute: Compute,
    events: Events,
    progress: Progress,
    max_batches: int | None,
) -> Evaluation:
    return Evaluation(
        model=trained.model,
        compute=compute,
        events=events,
        progress=progress,
        max_batches=max_batches,
    )


def _live(
    trained: Trained,
    config: Config,
    clipping: Clipping,
    stores: CheckpointStores,
    callbacks: CallbackManager,
    ctx: CallbackContext,
    progress: Progress,
    dialect: Dialect,
) -> LiveSettings:
    """The run's live settings (a dialect adds its own keys to the native ones)."""
    live = LiveSettings(
        trained=trained,
        config=config,
        clipping=clipping,
        persistent=stores.persistent,
        callbacks=callbacks,
        control=ctx.control,
        progress=progress,
        run=ctx.run,
    )
    return dialect.live(live) if dialect.live is not None else live


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


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"  # one GPU per process under torchrun
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available; use 'cpu' or 'auto'")
    return device
