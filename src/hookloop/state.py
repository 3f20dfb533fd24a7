"""What callbacks see (``TrainState``), what they may ask (``Control``, from
:mod:`hookloop.requests`), and the one object that carries both to every handler
(``CallbackContext``).

State is read, Control is asked, the loop decides: the loop writes its counters in a
:class:`Progress`, callbacks read the same object through :class:`TrainState`, which
refuses every assignment; a callback files a request on ``ctx.control`` and the loop
acts on it at a documented point (see :class:`~hookloop.requests.Control`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from hookloop.requests import Control, RewindRequest
from hookloop.rundir import RunDir
from hookloop.timers import Timers

if TYPE_CHECKING:
    import torch

__all__ = [
    "CallbackContext",
    "Control",
    "Progress",
    "Rewind",
    "RewindRequest",
    "RunInfo",
    "SaveTiming",
    "TrainState",
]


def _read_only(field: str, doc: str) -> property:
    def refuse(self: object, value: object) -> None:
        raise AttributeError(
            f"TrainState.{field} is read-only to callbacks; the loop owns its counters. "
            "Ask the loop through ctx.control (request_stop, request_save, ...) instead."
        )

    return property(attrgetter("_progress." + field), refuse, doc=doc)


class Progress:
    """The run's counters. Only its own methods write them, each named for what
    happened (a step began, an epoch ended, training stopped); the loop and its parts
    call them, and nothing else assigns a counter (tests/test_engine_faces.py checks).

    Callbacks read them through :class:`TrainState` (``ctx.state``), which shows the
    same object read-only. ``step`` counts optimizer steps begun: during every event
    of the N-th step (``on_train_step_start`` … ``on_train_step_end``) it equals N,
    and after the step it is the number of steps completed. Skipped steps count too.
    """

    __slots__ = (
        "epoch",
        "epoch_step",
        "failed",
        "flops",
        "in_training",
        "last_eval",
        "local_rank",
        "max_steps",
        "micro_step",
        "nonfinite_steps",
        "num_epochs",
        "open_step",
        "rank",
        "rewinds",
        "samples",
        "skipped_steps",
        "step",
        "steps_per_epoch",
        "stop_reason",
        "timers",
        "tokens",
        "will_log",
        "world_size",
    )

    #: The counters a checkpoint restores (rank and world size come from the launcher).
    RESUMABLE = (
        "step",
        "epoch",
        "epoch_step",
        "samples",
        "tokens",
        "flops",
        "skipped_steps",
        "nonfinite_steps",
        "last_eval",
    )

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0
        self.micro_step = 0
        self.samples = 0
        self.tokens = 0
        self.flops = 0.0
        self.max_steps: int | None = None
        self.num_epochs: int | None = None
        self.steps_per_epoch: int | None = None
        self.skipped_steps = 0
        self.nonfinite_steps = 0
        #: While a step is begun and its update not applied: the samples and FLOPs it
        #: added to the counters (a save then records the state as of the step before).
        self.open_step: tuple[int, float] | None = None
        self.rank = 0
        self.local_rank = 0
        self.world_size = 1
        self.stop_reason: str | None = None
        self.in_training = False
        self.failed = False
        self.will_log = False
        self.last_eval: dict[str, float] = {}
        self.rewinds: tuple[Rewind, ...] = ()
        self.timers = Timers()

    # -- the only writers: each names what happened in the run -------------------------
    def place(self, rank: int, local_rank: int, world_size: int) -> None:
        """Where this process runs (from the launcher)."""
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size

    def plan(
        self, steps_per_epoch: int | None, num_epochs: int | None, max_steps: int | None
    ) -> None:
        """The run's budget, as the loop (or a dialect's plan) worked it out."""
        self.steps_per_epoch, self.num_epochs, self.max_steps = (
            steps_per_epoch,
            num_epochs,
            max_steps,
        )

    def move_budget(self, max_steps: int) -> None:
        """A live ``set max_steps=N``: the step budget moves (the plan's epochs stay)."""
        self.max_steps = max_steps

    def use_timers(self, timers: Timers) -> None:
        self.timers = timers

    def start_training(self) -> None:
        """``train()`` begins: no stop reason yet, not failed."""
        self.stop_reason, self.failed = None, False

    def set_in_training(self, flag: bool) -> None:
        """Inside ``train()`` from ``on_train_start`` on (evaluations then count as training's)."""
        self.in_training = flag

    def begin_step(self) -> None:
        """A step begins (counted from here on, skipped or not)."""
        self.step += 1
        self.epoch_step += 1

    def plan_log(self, will_log: bool) -> None:
        """Whether the step begun ends with a log."""
        self.will_log = will_log

    def consume(self, samples: int, flops: float) -> None:
        """The samples the step begun reads (all ranks) and the FLOPs they cost."""
        self.samples += samples
        self.flops += flops

    def open_update(self, samples: int, flops: float) -> None:
        """The step computes; until :meth:`close_update` a save records the step before."""
        self.open_step = (samples, flops)

    def close_update(self) -> None:
        self.open_step = None

    def at_micro_step(self, index: int) -> None:
        self.micro_step = index

    def count_nonfinite(self) -> None:
        """This rank found the step's loss or gradients not finite."""
        self.nonfinite_steps += 1

    def count_skipped(self) -> None:
        """The step's update was skipped (agreed by every rank)."""
        self.skipped_steps += 1

    def add_flops(self, flops: float) -> None:
        self.flops += flops

    def add_tokens(self, tokens: int) -> None:
        self.tokens += tokens

    def next_epoch(self) -> None:
        self.epoch += 1
        self.epoch_step = 0

    def stop(self, reason: str, *, failed: bool = False) -> None:
        """Training ends, for ``reason`` (a failed run stays failed)."""
        self.stop_reason = reason
        self.failed |= failed

    def record_eval(self, metrics: dict[str, float]) -> None:
        self.last_eval = metrics

    def record_rewinds(self, rewinds: tuple[Rewind, ...]) -> None:
        self.rewinds = rewinds

    @contextlib.contextmanager
    def as_of_last_update(self) -> Iterator[None]:
        """Inside a step before its update, the counters as of the step before (a save
        asked for then records the state it holds, so a resume runs the step again)."""
        opened = self.open_step
        if opened is None:
            yield
            return
        samples, flops = opened
        self.step, self.epoch_step = self.step - 1, self.epoch_step - 1
        self.samples, self.flops, self.open_step = self.samples - samples, self.flops - flops, None
        try:
            yield
        finally:
            self.step, self.epoch_step = self.step + 1, self.epoch_step + 1
            self.samples, self.flops, self.open_step = (
                self.samples + samples,
                self.flops + flops,
                opened,
            )

    def copy(self) -> Progress:
        """These counters as they are now (the loop goes on changing its own)."""
        twin = Progress.__new__(Progress)
        for name in Progress.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.RESUMABLE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.RESUMABLE:
            if key in state:
                setattr(self, key, state[key])


class TrainState:
    """Progress counters of a run, as callbacks see them (``ctx.state``): read-only.

    The loop writes a :class:`Progress`; this is the same object behind read-only
    names. ``step`` counts optimizer steps begun: during every event of the N-th step
    (``on_train_step_start`` … ``on_train_step_end``) it equals N, and after the step
    it is the number of steps completed. Skipped steps count too.
    """

    __slots__ = ("_progress",)

    step = _read_only("step", "Optimizer steps begun (== completed, between steps).")
    epoch = _read_only("epoch", "Epoch in progress, 0-based.")
    epoch_step = _read_only("epoch_step", "Optimizer steps begun in the current epoch.")
    micro_step = _read_only("micro_step", "Micro-batch index inside the step, 0-based.")
    samples = _read_only("samples", "Training samples consumed (all ranks).")
    tokens = _read_only("tokens", "Training tokens consumed, when the batch reports them.")
    flops = _read_only("flops", "Estimated training FLOPs so far (0 without an estimate).")
    max_steps = _read_only("max_steps", "Step budget, or None when bounded by epochs only.")
    num_epochs = _read_only("num_epochs", "Epoch budget, or None when bounded by steps only.")
    steps_per_epoch = _read_only("steps_per_epoch", "Optimizer steps per epoch, if known.")
    skipped_steps = _read_only("skipped_steps", "Steps whose optimizer update was skipped.")
    nonfinite_steps = _read_only(
        "nonfinite_steps", "Steps skipped because loss or gradients were NaN/Inf."
    )
    rank = _read_only("rank", "Global rank of this process (0 without distributed).")
    local_rank = _read_only("local_rank", "Rank on this node.")
    world_size = _read_only("world_size", "Number of processes.")
    stop_reason = _read_only("stop_reason", "Why training ended, once it has.")
    failed = _read_only(
        "failed",
        "Whether the run failed (NaN, divergence, too many skipped steps): its stop or abort "
        "was filed with failed=True. A failed run exits with code 4.",
    )
    in_training = _read_only(
        "in_training", "Inside train(), from on_train_start on (False for a direct evaluate())."
    )
    last_eval = _read_only("last_eval", "Metrics of the latest evaluation (a dict).")
    rewinds = _read_only(
        "rewinds",
        "The divergences rolled back so far, oldest first (Rewind records: from and to step, "
        "batches skipped; see hookloop.checkpoint.rewind).",
    )
    timers = _read_only(
        "timers",
        "Named timers (hookloop.timers.Timers): the loop fills 'data-iterator', "
        "'forward-backward', 'optimizer', 'eval' and 'checkpoint-save' (train.timers).",
    )
    will_log = _read_only(
        "will_log",
        "Whether the current step ends with a log (scheduled, or requested before the step "
        "began): producers that must prepare a value during the step (e.g. per-parameter "
        "norms before the update) check it, so a requested log gets them too.",
    )

    def __init__(self, progress: Progress | None = None) -> None:
        self._progress = progress if progress is not None else Progress()

    @property
    def is_rank_zero(self) -> bool:
        return self._progress.rank == 0

    def snapshot(self) -> TrainState:
        """The counters as they are now, apart from the live ones the loop goes on moving
        (what a checkpoint announced later shows its handlers)."""
        return TrainState(self._progress.copy())

    def state_dict(self) -> dict[str, Any]:
        return self._progress.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._progress.load_state_dict(state)

    def __repr__(self) -> str:
        p = self._progress
        return (
            f"TrainState(step={p.step}, epoch={p.epoch}, samples={p.samples}, "
            f"max_steps={p.max_steps}, rank={p.rank}/{p.world_size})"
        )


@dataclass(frozen=True)
class RunInfo:
    """Facts about the run that callbacks need and the loop knows (``ctx.run``).

    Read these instead of the Trainer's attributes: they hold for any loop
    that builds a context, and they are the same for every dialect.
    """

    #: The run directory's layout, or None when the run writes no files.
    dir: RunDir | None = None
    #: The device the model trains on.
    device: torch.device | None = None
    #: What ``resume`` was asked for (``"auto"`` or a path), or None for a fresh start.
    resume: str | None = None
    #: The checkpoint actually restored, once it has been (None: started fresh).
    resumed_from: Any = None
    #: Whether checkpoints can be written (``request_save`` has an effect).
    can_checkpoint: bool = False
    #: Whether there is evaluation / test data (``request_evaluate`` has an effect).
    has_eval_data: bool = False
    has_test_data: bool = False
    #: Batches one evaluation / test pass runs, when known (``eval_max_batches`` applied).
    eval_batches: int | None = None
    test_batches: int | None = None

    @property
    def resuming(self) -> bool:
        """Whether this run was asked to continue from a checkpoint."""
        return self.resume is not None


@dataclass(frozen=True)
class Rewind:
    """One rollback (``state.rewinds``; ``ctx.rewind`` during the ``on_checkpoint_load`` it
    fires): confirmed at ``from_step``, restored ``to_step`` from ``checkpoint``; the
    divergence began at ``since_step``, where ``batches_skipped`` batches are skipped."""

    count: int
    from_step: int
    to_step: int
    since_step: int
    batches_skipped: int
    checkpoint: str
    reason: str
    lr_factor: float = 1.0
    lr_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class SaveTiming:
    """How long one checkpoint save took, and how much of it training waited for.

    ``blocked_seconds`` equals ``seconds`` for a synchronous save; an asynchronous
    save blocks only while state is copied off the training tensors."""

    seconds: float
    blocked_seconds: float


class CallbackContext:
    """The one object every handler receives.

    Always set: ``trainer``, ``state``, ``control``, ``run`` (:class:`RunInfo`),
    ``model``, ``optimizer``, ``scheduler``, ``config``, ``user_state``, and in training
    ``settings`` (the run's :class:`~hookloop.loop.live.LiveSettings`: what a live ``set``
    can change, its current values and the changes so far). Per-event
    fields are set only during the events that define them (``hookloop.events.EVENT_FIELDS``) and
    are ``None`` at every other time, so nothing stale leaks between events:

    - ``batch``: the micro-batch (``on_micro_step_*``, ``on_eval_step_*``, ``on_test_step_*``)
    - ``outputs``, ``loss``: the model output and that micro-batch's loss tensor (``*_step_end``)
    - ``loss_dict``: reduced losses of the step, 0-dim tensors (optimizer and step-end events)
    - ``grad_norm``: total gradient norm as a tensor, if it was computed
    - ``skipped_iter``: whether the step's update was skipped
    - ``logs``: the mutable dict of numbers for this log event (``on_before_log``, ``on_log``)
    - ``metrics`` (alias ``total_loss_dict``): evaluation results (``on_eval_end``, ``on_test_end``)
    - ``checkpoint_path``: the directory saved or loaded (``on_checkpoint_*``)
    - ``checkpoint_timing``: :class:`SaveTiming` of the save just committed (``on_checkpoint_save``)
    - ``non_loss_data``: what ``non_loss_data_func(model)`` returned (``on_eval_end``,
      ``on_test_end``)
    - ``exception``: the exception being raised (``on_exception``)
    - ``rewind``: the :class:`Rewind` of a rollback (``on_checkpoint_load`` fired by it)
    - ``changes``: the :class:`~hookloop.loop.live.SettingChange` records of a live ``set``
      just applied (``on_settings_change``)
    """

    __slots__ = (
        "batch",
        "changes",
        "checkpoint_path",
        "checkpoint_timing",
        "config",
        "control",
        "exception",
        "grad_norm",
        "logs",
        "loss",
        "loss_dict",
        "metrics",
        "model",
        "non_loss_data",
        "optimizer",
        "outputs",
        "rewind",
        "run",
        "scheduler",
        "settings",
        "skipped_iter",
        "state",
        "trainer",
        "user_state",
    )

    def __init__(
        self,
        *,
        trainer: Any = None,
        state: TrainState | None = None,
        control: Control | None = None,
        run: RunInfo | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        config: Any = None,
        user_state: dict[str, Any] | None = None,
    ) -> None:
        self.trainer = trainer
        self.state = state if state is not None else TrainState()
        self.control = control if control is not None else Control()
        self.run = run if run is not None else RunInfo()
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.config = config
        self.user_state = user_state if user_state is not None else {}
        self.settings: Any = None
        self.batch: Any = None
        self.outputs: Any = None
        self.loss: torch.Tensor | None = None
        self.loss_dict: dict[str, torch.Tensor] | None = None
        self.grad_norm: torch.Tensor | None = None
        self.skipped_iter: bool | None = None
        self.logs: dict[str, Any] | None = None
        self.metrics: dict[str, float] | None = None
        self.checkpoint_path: Any = None
        self.checkpoint_timing: SaveTiming | None = None
        self.non_loss_data: Any = None
        self.exception: BaseException | None = None
        self.rewind: Rewind | None = None
        self.changes: tuple[Any, ...] | None = None

    def clear_event_fields(self) -> None:
        """Reset every per-event field to None."""
        self.batch = self.outputs = self.loss = self.loss_dict = self.grad_norm = None
        self.skipped_iter = self.logs = self.metrics = self.checkpoint_path = self.rewind = None
        self.checkpoint_timing = self.exception = self.non_loss_data = self.changes = None

    @property
    def total_loss_dict(self) -> dict[str, float] | None:
        """Megatron-Bridge's name for ``metrics``."""
        return self.metrics

    def __repr__(self) -> str:
        return f"CallbackContext(state={self.state!r})"
