"""When the loop logs, evaluates, saves and stops: the :class:`Schedule`.

At the end of a step (and of an epoch) the schedule takes the requests callbacks
filed, agreed across ranks (:mod:`hookloop.requests`), adds what is due (the
``train.*`` intervals, the exit conditions, the step budget) and returns a *plan*:
the actions to carry out, in order, each a request kind and its values
(``("log", {})``, ``("stop", {"reason": "exit_interval", "failed": False})``). It is
a generator, so after an action has run (a log whose handler asked to stop, say)
it looks at the requests again before deciding the rest. The loop carries each
action out with one handler per kind (:meth:`hookloop.loop.trainer.Trainer.act`).

A dialect brings its own schedule (transformers' Trainer decides through the flags
its ``DefaultFlowCallback`` sets); the loop and its handlers stay the same.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hookloop.requests import BUILT_IN_KINDS, KINDS, NO_REQUESTS, Control, Requests
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


class Schedule:
    """The native schedule: ``train.log_every``, ``eval_every``, ``eval_at_epoch_end``,
    the checkpoint intervals, ``exit_interval``, ``exit_duration_minutes``, the step and
    epoch budget, and whatever callbacks requested.

    Read after every step, so kept as plain attributes: ``next_boundary`` (the next step
    whose end has something on the schedule), and three policies a dialect may change:
    ``opens_every_epoch`` (``on_epoch_start`` also when resuming mid-epoch),
    ``steps_partial_group`` (an epoch's last, short accumulation group is stepped,
    not dropped), ``ends_epochs_early`` (a request may end an epoch; see :meth:`epoch_stop`).
    """

    opens_every_epoch = False
    steps_partial_group = False
    ends_epochs_early = False

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
    ) -> None:
        self.config, self.progress, self.control, self.signals = config, progress, control, signals
        self.device, self.has_eval, self.checkpointer = device, has_eval, checkpointer
        self.next_boundary = 0
        self.last_eval_step = -1  # the step of the latest evaluation in training
        self.started = time.monotonic()
        self.skip_steps: frozenset[int] = frozenset()

    # -- the budget ---------------------------------------------------------------
    def budget_reason(self) -> str | None:
        """Why training ends when the step budget is spent (None: the epoch's end decides)."""
        return "max_steps" if self.config.max_steps else "max_epochs"

    # -- through the run ----------------------------------------------------------
    def begin(self) -> None:
        """``train()`` starts: the clock for ``exit_duration_minutes``, the steps to skip."""
        self.started = time.monotonic()
        self.skip_steps = frozenset(self.config.iterations_to_skip)
        self.next_boundary = 0  # the first boundary works out when the next is due

    def will_log(self) -> bool:
        """Whether the step beginning now ends with a log: scheduled, or asked for before it.

        A log requested during the step is written at its end too, but producers learn of
        it only then. With several ranks a pending request is not counted here: the
        control server files them on rank 0 alone, and every rank must decide the same.
        """
        every, st = self.config.log_every, self.progress
        if every and st.step % every == 0:
            return True
        return st.world_size == 1 and self.control.log_requested

    def plan_next(self) -> None:
        """Work out ``next_boundary`` again (after every boundary that acts, so an interval
        a callback changes mid-run applies from then on). Every step with several ranks
        (they agree on requests at each boundary) or with a time limit to watch."""
        cfg, step = self.config, self.progress.step
        if self.progress.world_size > 1 or cfg.exit_duration_minutes is not None:
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
        requests = self.control.drain(signal=caught, world_size=world_size, device=self.device)
        if requests.signal:
            self.signals.caught = requests.signal  # a signal caught on another rank stops this one
        return requests

    # -- the plans ----------------------------------------------------------------
    def at_step_end(self) -> Iterator[Action]:
        """A step's end: log, evaluate, then a rewind, a stop or a save (see the module doc)."""
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

    def evaluates_before_epoch_end(self) -> bool:
        """Whether the epoch's end evaluates before ``on_epoch_end`` (``eval_at_epoch_end``,
        unless an evaluation already ran at this step)."""
        return (
            self.has_eval
            and self.config.eval_at_epoch_end
            and self.last_eval_step != self.progress.step
        )

    def closes_epoch(self, ended: str) -> bool:
        """Whether an epoch whose steps ended so (``exhausted``, ``budget``, ``stopped``,
        ``epoch_stop``) gets its end: the data ran out, or the budget ran out exactly at
        the epoch's end (mid-epoch, there is no epoch end: a longer resume stays exact)."""
        st = self.progress
        return ended == "exhausted" or (ended == "budget" and st.epoch_step == st.steps_per_epoch)

    def advances_epoch(self, ended: str) -> bool:
        """Whether the epoch counter moves on after ``on_epoch_end``."""
        return True

    def at_epoch_end(self) -> Iterator[Action]:
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

    def epoch_stop(self) -> bool:
        """Whether the epoch ends after this step (read only with ``ends_epochs_early``)."""
        return False

    def finish(self) -> None:
        """Training ends (not by an abort), before the last save and ``on_train_end``."""

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
