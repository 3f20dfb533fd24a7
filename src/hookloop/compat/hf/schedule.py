"""transformers' flow over the loop's boundaries: :class:`HFFlow`, the native schedule's
:class:`~hookloop.loop.schedule.Flow`.

``DefaultFlowCallback`` sets ``should_log`` / ``should_evaluate`` / ``should_save`` /
``should_training_stop`` after each step and epoch, before any user callback sees
them; the flags still set afterwards decide the log, then the evaluation, then the
save (``_maybe_log_save_evaluate``). Every epoch opens with ``on_epoch_begin`` (a
resume too), an epoch's last, partial accumulation group is stepped,
``should_epoch_stop`` ends an epoch, every epoch left (but by an abort) ends with
``on_epoch_end``, and ``on_epoch_end`` comes before the epoch's evaluation. The end
of training logs HF's summary (``train_runtime``, ``train_loss``, ...) and reloads
the best checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hookloop.compat.hf import flow
from hookloop.loop.parts import Parts
from hookloop.loop.schedule import Action, Flow, Schedule, abort, passed_through
from hookloop.state import Progress


class HFFlow:
    """The decisions HF's flow makes differently (see the module doc); :meth:`as_flow`
    hands them to the native schedule."""

    def __init__(self, *, session: Any, logbook: Any, ctx: Any, progress: Progress) -> None:
        self.session, self.logbook, self.ctx, self.progress = session, logbook, ctx, progress

    def as_flow(self) -> Flow:
        return Flow(
            opens_every_epoch=True,
            steps_partial_group=True,
            closes_every_epoch=True,
            logs_also=self.logs_also,
            decide=self.decide,
            epoch_stop=self.epoch_stop,
            finish=self.finish,
        )

    def logs_also(self) -> bool:
        """``ctx.state.will_log`` beyond the steps strategy (the native schedule): the first
        step with ``logging_first_step``, an epoch's last step with the epoch strategy. A
        callback may still clear ``should_log``."""
        args, st = self.session.args, self.progress
        if st.step == 1 and getattr(args, "logging_first_step", False):
            return True
        last_of_epoch = st.epoch_step == st.steps_per_epoch or (
            st.max_steps is not None and st.step >= st.max_steps
        )
        return flow.strategy(args, "logging_strategy") == "epoch" and last_of_epoch

    def decide(self, schedule: Schedule) -> Iterator[Action]:
        """``_maybe_log_save_evaluate`` on the flags the handlers left set."""
        st, flags, session = self.progress, self.session.control, self.session
        requests = schedule.take_requests()  # native callbacks' requests join HF's flags
        yield from passed_through(requests)
        flags.should_log |= requests.log
        flags.should_evaluate |= requests.evaluate
        if flags.should_log and st.step > session.last_logged_step:
            yield "log", {}
        if flags.should_evaluate and schedule.has_eval:
            yield "evaluate", {}
        requests = requests.merge(schedule.take_requests())  # filed by log or eval handlers
        if requests.abort:
            yield abort(requests)
            return
        flags.should_save |= requests.save
        if flags.should_save and schedule.checkpointer.persistent is not None:
            yield "save", {}
        if flags.should_training_stop and st.stop_reason is None:
            at_budget = st.max_steps is not None and st.step >= st.max_steps
            reason = "max_steps" if at_budget else requests.stop or "should_training_stop"
            yield "stop", {"reason": reason, "failed": requests.failed}
            return
        other = schedule.stop_reason(requests) if st.stop_reason is None else None
        if other is not None:  # a request or a signal, exit_interval, exit_duration_minutes
            yield "stop", {"reason": other, "failed": requests.failed}

    def epoch_stop(self) -> bool:
        return bool(self.session.control.should_epoch_stop)

    def finish(self) -> None:
        """HF's end of training: the summary log, the best checkpoint's weights when
        ``load_best_model_at_end``, and with ``save_total_limit=1`` the best folder alone."""
        self.logbook.summary()
        self.session.load_best_model(self.ctx)
        self.session.prune_after_training()


def flow_of(p: Parts, *, session: Any) -> Flow:
    """The dialect's flow (the ``Dialect.flow`` factory) for the native schedule."""
    return HFFlow(session=session, logbook=p.logbook, ctx=p.ctx, progress=p.progress).as_flow()
