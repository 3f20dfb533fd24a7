"""When the loop logs, evaluates, saves and stops: the :class:`Schedule`.

At the end of a step (and of an epoch) the schedule takes the requests callbacks
filed, agreed across ranks (:mod:`hookloop.requests`), adds what is due (the
``train.*`` intervals, the exit conditions, the step budget) and returns a *plan*:
the actions to carry out, in order, each a request kind and its values
(``("log", {})``, ``("stop", {"reason": "exit_interval", "failed": False})``). It is
a generator, so after an action has run (a log whose handler asked to stop, say)
it looks at the requests again before deciding the rest. The loop carries each
action out with one handler per kind (:meth:`hookloop.loop.trainer.Trainer.act`).

The loop asks one question at each boundary: :meth:`Schedule.opens_epoch` as an
epoch opens, :meth:`Schedule.will_log` as a step begins, :meth:`Schedule.at_step_end`
(a plan) and :meth:`Schedule.at_epoch_end` (given why the steps ended, an
:class:`EpochEnd`: an :class:`EpochPlan`), and :meth:`Schedule.finish`.

A dialect changes none of its methods: it gives the schedule a :class:`Flow`, the few
decisions its system makes differently (transformers' Trainer decides from the flags
its ``DefaultFlowCallback`` sets, opens every epoch, steps a partial group, ...). The
loop and its handlers stay the same.
"""

from __future__ import annotations

import enum
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from hookloop.requests import BUILT_IN_KINDS, KINDS, NO_REQUESTS, Control, Requests
from hookloop.result import is_abort
from hookloop.state import Progress

#: One step of a plan: a request kind (or ``save_local``) and its values.
Action = tuple[str, dict[str, Any]]


class StopSignals:
    """SIGTERM and SIGINT set ``caught``; the loop finishes the step, saves and exits.

    A second SIGINT raises KeyboardInterrupt at once, for a user who means it.
    ``signals`` names the signals taken over instead (Megatron-Bridge's
    ``train.exit_signal``, say); it may be changed until :meth:`install`.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.caught: int | None = None
        self.signals: tuple[int, ...] = tuple(signals)

    def install(self) -> Callable[[], None] | None:
        """Take over the two signals (main thread only); returns what puts them back."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_signal(signum: int, frame: Any) -> None:
            if self.caught == signal.SIGINT and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.caught = signum

        previous = {s: signal.signal(s, on_signal) for s in self.signals}

        def restore() -> None:
            for s, handler in previous.items():
                signal.signal(s, handler)

        return restore


class EpochEnd(enum.Enum):
    """Why an epoch's steps ended: what the loop tells :meth:`Schedule.at_epoch_end`."""

    BUDGET = "budget"  # the step budget is spent
    EXHAUSTED = "exhausted"  # the epoch's data ran out
    STOPPED = "stopped"  # a plan's action left the epoch: a stop, an abort or a rewind
    EPOCH_STOP = "epoch_stop"  # the flow ended the epoch early (:attr:`Flow.epoch_stop`)


@dataclass(frozen=True)
class EpochPlan:
    """What the loop does at an epoch's end, in this order."""

    #: Why training ends, when the epoch ended by spending the step budget (None: it goes on,
    #: or the plan's actions decide).
    stop_reason: str | None
    #: Whether the epoch gets its end; False: left mid-epoch, no epoch-end events, so a
    #: longer resume stays exact.
    closes: bool
    #: Whether an evaluation runs before ``on_epoch_end`` (``train.eval_at_epoch_end``).
    evaluates_first: bool
    #: Whether the epoch counter moves on after ``on_epoch_end``.
    advances: bool
    #: The plan after ``on_epoch_end`` (a generator: it reads the requests filed during it).
    actions: Iterator[Action]


@dataclass(frozen=True)
class Flow:
    """The decisions a dialect's flow makes differently from ``train.*``; each field left
    at its default is the native decision.

    ``decide(schedule)`` replaces the plan at a step's end. With it the schedule looks at
    every step's end, plans an epoch's end the same way and then stops at the epoch or
    step budget (a budget spent mid-epoch sets no stop reason of its own), and leaves
    ``train.eval_at_epoch_end``'s evaluation before ``on_epoch_end`` to the flow.
    """

    #: ``on_epoch_start`` also when an epoch is resumed mid-way.
    opens_every_epoch: bool = False
    #: An epoch's last, short accumulation group is stepped, not dropped.
    steps_partial_group: bool = False
    #: An epoch left mid-way (a stop, the budget, an early end; not an abort) still ends.
    closes_every_epoch: bool = False
    #: More steps that log than ``train.log_every`` and the requests say.
    logs_also: Callable[[], bool] | None = None
    #: The plan at a step's (and an epoch's) end in place of the native one.
    decide: Callable[[Schedule], Iterator[Action]] | None = None
    #: Read after each step: whether the epoch ends there (with ``closes_every_epoch``;
    #: without it the epoch goes on where it was left, as after a resume).
    epoch_stop: Callable[[], bool] | None = None
    #: Training ends (not by an abort), before the last save and ``on_train_end``.
    finish: Callable[[], None] | None = None


#: The native flow: ``train.*`` decides everything.
NATIVE_FLOW = Flow()


class Schedule:
    """The schedule: ``train.log_every``, ``eval_every``, ``eval_at_epoch_end``, the
    checkpoint intervals, ``exit_interval``, ``exit_duration_minutes``, the step and epoch
    budget, and whatever callbacks requested; a dialect's :class:`Flow` changes a few of
    these decisions.

    Read after every step, so kept as plain attributes: ``next_boundary`` (the next step
    whose end has something on the schedule), ``skip_steps`` (``train.iterations_to_skip``)
    and ``flow``.
    """

    def __init__(
        self,
        *,
        config: Any,
        progress: Progress,
        control: Control,
        signals: StopSignals,
        device: Any,
        has_eval: bool,
        checkpointer: Any,
        flow: Flow = NATIVE_FLOW,
    ) -> None:
        self.config, self.progress, self.control, self.signals = config, progress, control, signals
        self.device, self.has_eval, self.checkpointer = device, has_eval, checkpointer
        self.flow = flow
        self.next_boundary = 0
        self.last_eval_step = -1  # the step of the latest evaluation the schedule planned
        self.started = time.monotonic()
        self.skip_steps: frozenset[int] = frozenset()

    # -- through the run ----------------------------------------------------------
    def begin(self) -> None:
        """``train()`` starts: the clock for ``exit_duration_minutes``, the steps to skip."""
        self.started = time.monotonic()
        self.skip_steps = frozenset(self.config.iterations_to_skip)
        self.next_boundary = 0  # the first boundary works out when the next is due

    def opens_epoch(self) -> bool:
        """Whether the epoch starting now fires ``on_epoch_start`` (not a resumed one)."""
        return self.progress.epoch_step == 0 or self.flow.opens_every_epoch

    def will_log(self) -> bool:
        """Whether the step beginning now ends with a log: scheduled, or asked for before it.

        A log requested during the step is written at its end too, but producers learn of
        it only then. With several ranks a pending request is not counted here: the
        control server files them on rank 0 alone, and every rank must decide the same.
        """
        every, st = self.config.log_every, self.progress
        if every and st.step % every == 0:
            return True
        if st.world_size == 1 and self.control.log_requested:
            return True
        logs_also = self.flow.logs_also
        return logs_also is not None and logs_also()

    def plan_next(self) -> None:
        """Work out ``next_boundary`` again (after every boundary that acts, so an interval
        a callback changes mid-run applies from then on). Every step with several ranks
        (they agree on requests at each boundary), with a time limit to watch, or when
        the flow decides."""
        cfg, step = self.config, self.progress.step
        if (
            self.progress.world_size > 1
            or cfg.exit_duration_minutes is not None
            or self.flow.decide is not None
        ):
            self.next_boundary = step + 1
            return
        intervals = [cfg.log_every, cfg.exit_interval, *self.checkpointer.intervals()]
        if self.has_eval:
            intervals.append(cfg.eval_every)
        due = [(step // n + 1) * n for n in intervals if n]
        self.next_boundary = min([*due, self.control.next_due], default=sys.maxsize)

    def take_requests(self) -> Requests:
        """The requests filed since the last look and a caught signal, agreed across ranks."""
        caught, world_size = self.signals.caught, self.progress.world_size
        if self.control.next_due <= self.progress.step:  # a replayed change is due
            self.control.file_due(self.progress.step)
        if caught is None and world_size == 1 and not self.control.pending:
            return NO_REQUESTS  # what drain() returns then, without its calls
        requests = self.control.drain(
            signal=caught,
            world_size=world_size,
            device=self.device,
            skipped=self.progress.skipped_steps,
        )
        if requests.signal:
            self.signals.caught = requests.signal  # a signal caught on another rank stops this one
        return requests

    def finish(self) -> None:
        """Training ends (not by an abort), before the last save and ``on_train_end``."""
        if self.flow.finish is not None:
            self.flow.finish()

    # -- the plans ----------------------------------------------------------------
    def at_step_end(self) -> Iterator[Action]:
        """A step's end: the plan (the flow's, or log, evaluate, then a rewind, a stop or
        a save; see the module doc), then when the next boundary is due."""
        decide = self.flow.decide
        yield from self._step_plan() if decide is None else decide(self)
        self.plan_next()

    def _step_plan(self) -> Iterator[Action]:
        cfg, st = self.config, self.progress
        requests = self.take_requests()
        yield from passed_through(requests)
        if requests.abort:
            yield abort(requests)
            return
        ran = False
        if requests.log or st.will_log:
            yield "log", {}
            ran = True
        every = cfg.eval_every
        if self.has_eval and (requests.evaluate or (every and st.step % every == 0)):
            yield "evaluate", {}
            self.last_eval_step = st.step
            ran = True
        if ran:  # a log or eval handler may have asked to stop (e.g. early stopping)
            later = self.take_requests()
            yield from passed_through(later)
            self.carry_over(later)
            if later is not NO_REQUESTS:  # usual: nothing was filed during the log
                requests = requests.merge(later)
        if requests.abort:
            yield abort(requests)
            return
        if requests.rewind is not None and (requests.failed or not requests.stop):
            yield "rewind", {"request": requests.rewind}  # a detector's failed stop yields to it
            return
        reason = self.stop_reason(requests)
        if reason is not None:
            yield "stop", {"reason": reason, "failed": requests.failed}
        elif self.checkpointer.due(st.step, requested=requests.save):
            yield "save", {}
        elif self.checkpointer.local_due(st.step):
            yield "save_local", {}

    def at_epoch_end(self, ended: EpochEnd) -> EpochPlan:
        """The epoch's steps ended so: whether and how the epoch ends (see
        :class:`EpochPlan`). Natively an epoch ends when its data ran out, or when the
        budget ran out exactly at its end; it evaluates first with ``eval_at_epoch_end``,
        unless an evaluation already ran at this step."""
        st, flow = self.progress, self.flow
        budget = ended is EpochEnd.BUDGET and st.stop_reason is None and flow.decide is None
        complete = ended is EpochEnd.EXHAUSTED or st.epoch_step == st.steps_per_epoch
        if flow.closes_every_epoch:
            closes = not is_abort(st.stop_reason)
        else:
            closes = ended is EpochEnd.EXHAUSTED or (ended is EpochEnd.BUDGET and complete)
        evaluates = (
            closes
            and flow.decide is None
            and self.has_eval
            and self.config.eval_at_epoch_end
            and self.last_eval_step != st.step
        )
        if evaluates:
            self.last_eval_step = st.step
        epoch_stop = flow.epoch_stop
        stopped_early = epoch_stop is not None and ended is not EpochEnd.STOPPED and epoch_stop()
        reason = None
        if budget:
            reason = "max_steps" if self.config.max_steps else "max_epochs"
        return EpochPlan(
            stop_reason=reason,
            closes=closes,
            evaluates_first=evaluates,
            advances=complete or stopped_early,
            actions=self._after_epoch_end() if flow.decide is None else self._decided_epoch_end(),
        )

    def _after_epoch_end(self) -> Iterator[Action]:
        """After ``on_epoch_end``: what was filed during it (early stopping on the
        evaluation, say). A log or evaluation asked for here waits for the next step."""
        st = self.progress
        requests = self.take_requests()
        yield from passed_through(requests)
        self.carry_over(requests)
        if requests.abort:
            yield abort(requests)
            return
        if requests.rewind is not None and (requests.failed or not requests.stop):
            yield "rewind", {"request": requests.rewind}
            return
        if st.stop_reason is None:
            reason = self.stop_reason(requests)
            if reason is not None:
                yield "stop", {"reason": reason, "failed": requests.failed}
        if requests.save and self.checkpointer.persistent is not None:
            yield "save", {}  # also after the last epoch

    def _decided_epoch_end(self) -> Iterator[Action]:
        """After ``on_epoch_end`` in a flow that decides: its plan, then the budget."""
        st, decide = self.progress, self.flow.decide
        assert decide is not None
        yield from decide(self)
        if st.stop_reason is None and st.num_epochs is not None and st.epoch >= st.num_epochs:
            yield "stop", {"reason": "max_epochs"}
        if st.stop_reason is None and st.max_steps is not None and st.step >= st.max_steps:
            yield "stop", {"reason": "max_steps"}

    # -- helpers ------------------------------------------------------------------
    def stop_reason(self, requests: Requests) -> str | None:
        """A stop other than the budget: a request or a signal, ``exit_interval``,
        ``exit_duration_minutes``; None when training goes on."""
        cfg, st = self.config, self.progress
        if requests.stop:
            caught = self.signals.caught
            return f"signal {signal.Signals(caught).name}" if caught else requests.stop
        if cfg.exit_interval and st.step % cfg.exit_interval == 0:
            return "exit_interval"
        minutes = cfg.exit_duration_minutes
        if minutes is not None and time.monotonic() - self.started >= minutes * 60:
            return "exit_duration"
        return None

    def carry_over(self, requests: Requests) -> None:
        """A log or evaluation asked for where none can run now waits for the next step."""
        if requests.log:
            self.control.request_log()
        if requests.evaluate:
            self.control.request_evaluate()


def abort(requests: Requests) -> Action:
    return "abort", {"reason": requests.abort, "failed": requests.failed}


def passed_through(requests: Requests) -> Iterable[Action]:
    """The requests of kinds no schedule decides on (registered later, such as a
    command of the control server), in the order they are registered."""
    if len(requests) and not requests.keys() <= BUILT_IN_KINDS:
        for kind in KINDS:
            if kind in requests and kind not in BUILT_IN_KINDS:
                yield kind, requests[kind]
