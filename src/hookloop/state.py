"""What callbacks see (``TrainState``), what they may ask (``Control``), and the
one object that carries both to every handler (``CallbackContext``).

State is read, Control is asked, the loop decides: a callback never changes the
loop's counters; it files a request on ``ctx.control`` and the loop acts on it
at a documented point (see :class:`Control`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from hookloop.distributed import agree_flags, gather_objects
from hookloop.rundir import RunDir
from hookloop.timers import Timers

if TYPE_CHECKING:
    import torch


def _read_only(field: str, doc: str) -> property:
    def refuse(self: object, value: object) -> None:
        raise AttributeError(
            f"TrainState.{field} is read-only to callbacks; the loop owns its counters. "
            "Ask the loop through ctx.control (request_stop, request_save, ...) instead."
        )

    return property(attrgetter("_" + field), refuse, doc=doc)


class TrainState:
    """Progress counters of a run. The loop writes them; callbacks read them.

    ``step`` counts optimizer steps begun: during every event of the N-th step
    (``on_train_step_start`` … ``on_train_step_end``) it equals N, and after the
    step it is the number of steps completed. Skipped steps count too.
    """

    __slots__ = (
        "_epoch",
        "_epoch_step",
        "_failed",
        "_flops",
        "_in_training",
        "_last_eval",
        "_local_rank",
        "_max_steps",
        "_micro_step",
        "_nonfinite_steps",
        "_num_epochs",
        "_rank",
        "_rewinds",
        "_samples",
        "_skipped_steps",
        "_step",
        "_steps_per_epoch",
        "_stop_reason",
        "_timers",
        "_tokens",
        "_will_log",
        "_world_size",
    )

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

    def __init__(self) -> None:
        self._step = 0
        self._epoch = 0
        self._epoch_step = 0
        self._micro_step = 0
        self._samples = 0
        self._tokens = 0
        self._flops = 0.0
        self._max_steps: int | None = None
        self._num_epochs: int | None = None
        self._steps_per_epoch: int | None = None
        self._skipped_steps = 0
        self._nonfinite_steps = 0
        self._rank = 0
        self._local_rank = 0
        self._world_size = 1
        self._stop_reason: str | None = None
        self._in_training = False
        self._failed = False
        self._will_log = False
        self._last_eval: dict[str, float] = {}
        self._rewinds: tuple[Rewind, ...] = ()
        self._timers = Timers()

    @property
    def is_rank_zero(self) -> bool:
        return self._rank == 0

    #: Counters that a checkpoint restores (rank and world size come from the launcher).
    _RESUMABLE = (
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

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, "_" + k) for k in self._RESUMABLE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self._RESUMABLE:
            if key in state:
                setattr(self, "_" + key, state[key])

    def __repr__(self) -> str:
        return (
            f"TrainState(step={self._step}, epoch={self._epoch}, samples={self._samples}, "
            f"max_steps={self._max_steps}, rank={self._rank}/{self._world_size})"
        )


class Control:
    """Requests from callbacks (or the control server's thread) to the loop.

    Where the loop acts on each request:

    - ``skip_step()``: just before ``optimizer.step()`` of the current step
      (so it may be called up to ``on_before_optimizer_step``); the step then
      counts as skipped.
    - ``request_log()``, ``request_evaluate()``, ``request_save()``,
      ``request_stop()``, ``request_abort()``: at the end of the current step,
      after ``on_train_step_end``, in that order (log, evaluate, save, stop).
      A stop saves a checkpoint when checkpointing is configured; an abort ends
      at once and saves nothing. Requests filed outside a step wait for the next.

    Requests are thread-safe: another thread may file them at any time.
    """

    __slots__ = (
        "_abort",
        "_evaluate",
        "_failed",
        "_lock",
        "_log",
        "_pending",
        "_rewind",
        "_save",
        "_skip",
        "_stop",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = False  # one cheap read per step tells the loop whether to look
        self._skip = False
        self._log = False
        self._evaluate = False
        self._save = False
        self._stop: str | None = None
        self._abort: str | None = None
        self._failed = False
        self._rewind: RewindRequest | None = None

    # -- asking ------------------------------------------------------------
    def request_stop(self, reason: str = "stop requested", *, failed: bool = False) -> None:
        """Finish the current step, save (if checkpointing is on), and end training.

        ``failed=True`` marks the run as failed (a detector that found NaN or a
        divergence): it still saves, but exits with code 4 and shows as failed.
        """
        with self._lock:
            self._stop = self._stop or str(reason)
            self._failed = self._failed or bool(failed)
            self._pending = True

    def request_abort(self, reason: str = "abort requested", *, failed: bool = False) -> None:
        """End training after the current step without saving anything (``failed``: as above)."""
        with self._lock:
            self._abort = self._abort or str(reason)
            self._failed = self._failed or bool(failed)
            self._pending = True

    def request_rewind(
        self,
        since_step: int,
        *,
        reason: str = "rewind requested",
        skip_batches: int | None = None,
        lr_factor: float = 1.0,
        lr_steps: int = 0,
    ) -> None:
        """Roll back to the last checkpoint before step ``since_step`` (where a divergence
        began) and go on, skipping ``skip_batches`` batches from there (see
        :mod:`hookloop.checkpoint.rewind`). Acted on at the end of the current step, before a
        save."""
        request = RewindRequest(since_step, reason, skip_batches, lr_factor, lr_steps)
        with self._lock:
            self._rewind = self._rewind or request
            self._pending = True

    def request_save(self) -> None:
        """Write a checkpoint at the end of the current step."""
        with self._lock:
            self._save = True
            self._pending = True

    def request_evaluate(self) -> None:
        """Run an evaluation at the end of the current step."""
        with self._lock:
            self._evaluate = True
            self._pending = True

    def request_log(self) -> None:
        """Fire the logging events at the end of the current step, even if not due."""
        with self._lock:
            self._log = True
            self._pending = True

    def skip_step(self) -> None:
        """Do not apply this step's optimizer update (gradients are discarded)."""
        self._skip = True

    # -- reading (for callbacks that coordinate) ---------------------------
    @property
    def stop_requested(self) -> bool:
        return self._stop is not None or self._abort is not None

    @property
    def abort_requested(self) -> bool:
        return self._abort is not None

    @property
    def log_requested(self) -> bool:
        """A log request is pending (the loop reads it when a step begins)."""
        return self._log

    # -- draining (the loop's side) ----------------------------------------
    def take(self) -> Requests:
        """Return and clear every pending request of this process."""
        if not self._pending:
            return NO_REQUESTS
        with self._lock:
            taken = Requests(
                self._log, self._evaluate, self._save, self._stop, self._abort, None, self._failed
            )
            taken.rewind = self._rewind
            self._log = self._evaluate = self._save = self._failed = False
            self._stop = self._abort = self._rewind = None
            self._pending = False
        return taken

    def take_skip(self) -> bool:
        skip, self._skip = self._skip, False
        return skip

    def drain(
        self, *, signal: int | None = None, world_size: int = 1, device: Any = None
    ) -> Requests:
        """Take the pending requests and a caught ``signal``, agreed across ranks.

        With several ranks, every rank returns the same answer: a request filed
        on any rank (the control server lives on rank 0) holds for all, and a
        stop or abort carries the reason the asking rank gave. One small
        collective; a second only when someone asked to stop.
        """
        requests = self.take()
        if signal is not None:
            requests = requests.merge(Requests(False, False, False, "signal", None, signal))
        if world_size == 1:
            return requests
        log, evaluate, save, stop, abort, signum, failed, rewind = agree_flags(
            [
                int(requests.log),
                int(requests.evaluate),
                int(requests.save),
                int(requests.stop is not None),
                int(requests.abort is not None),
                requests.signal or 0,
                int(requests.failed),
                int(requests.rewind is not None),
            ],
            device,
        )
        stop_reason = abort_reason = None
        if stop or abort:  # rare: every rank reports the reason the asking rank gave
            reasons = gather_objects((requests.stop, requests.abort))
            stop_reason = next((s for s, _ in reasons if s), "stop requested") if stop else None
            abort_reason = next((a for _, a in reasons if a), "abort requested") if abort else None
        agreed = Requests(
            bool(log),
            bool(evaluate),
            bool(save),
            stop_reason,
            abort_reason,
            signum or None,
            bool(failed),
        )
        if rewind:  # rare: every rank takes the first asking rank's request
            agreed.rewind = next(r for r in gather_objects(requests.rewind) if r is not None)
        return agreed


class Requests:
    """A snapshot of the requests drained at one step boundary.

    ``signal`` is the number of a caught SIGTERM/SIGINT (which also files a stop);
    ``failed``: the stop or abort was filed as a failure.
    """

    __slots__ = ("abort", "evaluate", "failed", "log", "rewind", "save", "signal", "stop")

    def __init__(
        self,
        log: bool,
        evaluate: bool,
        save: bool,
        stop: str | None,
        abort: str | None,
        signal: int | None = None,
        failed: bool = False,
    ) -> None:
        self.log = log
        self.evaluate = evaluate
        self.save = save
        self.stop = stop
        self.abort = abort
        self.signal = signal
        self.failed = failed
        self.rewind: RewindRequest | None = None  # see Control.request_rewind

    def merge(self, other: Requests) -> Requests:
        merged = Requests(
            self.log or other.log,
            self.evaluate or other.evaluate,
            self.save or other.save,
            self.stop or other.stop,
            self.abort or other.abort,
            self.signal or other.signal,
            self.failed or other.failed,
        )
        merged.rewind = self.rewind or other.rewind
        return merged

    def __repr__(self) -> str:
        return (
            f"Requests(log={self.log}, evaluate={self.evaluate}, save={self.save}, "
            f"stop={self.stop!r}, abort={self.abort!r}, signal={self.signal!r}, "
            f"failed={self.failed})"
        )


#: Nothing asked (shared: never mutated).
NO_REQUESTS = Requests(False, False, False, None, None)


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
class RewindRequest:
    """What :meth:`Control.request_rewind` asks: roll back past ``since_step``, skip data."""

    since_step: int
    reason: str
    skip_batches: int | None = None
    lr_factor: float = 1.0
    lr_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.since_step, bool) or not isinstance(self.since_step, int):
            raise ValueError(f"since_step must be a step number >= 1, got {self.since_step!r}")
        if self.since_step < 1:
            raise ValueError(f"since_step must be a step number >= 1, got {self.since_step}")
        skip = self.skip_batches
        if skip is not None and (isinstance(skip, bool) or not isinstance(skip, int) or skip < 0):
            raise ValueError(f"skip_batches must be an int >= 0 or None, got {skip!r}")
        factor = self.lr_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ValueError(f"lr_factor must be a finite number > 0, got {factor!r}")
        if not 0 < factor < float("inf"):
            raise ValueError(f"lr_factor must be a finite number > 0, got {factor!r}")
        steps = self.lr_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"lr_steps must be an int >= 0, got {steps!r}")


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
    ``model``, ``optimizer``, ``scheduler``, ``config``, ``user_state``. Per-event
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
    """

    __slots__ = (
        "batch",
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

    def clear_event_fields(self) -> None:
        """Reset every per-event field to None."""
        self.batch = self.outputs = self.loss = self.loss_dict = self.grad_norm = None
        self.skipped_iter = self.logs = self.metrics = self.checkpoint_path = self.rewind = None
        self.checkpoint_timing = self.exception = self.non_loss_data = None

    @property
    def total_loss_dict(self) -> dict[str, float] | None:
        """Seed-000 name for ``metrics``."""
        return self.metrics

    def __repr__(self) -> str:
        return f"CallbackContext(state={self.state!r})"
