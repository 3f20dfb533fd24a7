"""transformers' flow over the loop's boundaries: :class:`HFSchedule`.

``DefaultFlowCallback`` sets ``should_log`` / ``should_evaluate`` / ``should_save`` /
``should_training_stop`` after each step and epoch, before any user callback sees
them; the flags still set afterwards decide the log, then the evaluation, then the
save (``_maybe_log_save_evaluate``). Every epoch opens with ``on_epoch_begin`` (a
resume too), an epoch's last, partial accumulation group is stepped,
``should_epoch_stop`` ends an epoch, and ``on_epoch_end`` comes before the epoch's
evaluation. The end of training logs HF's summary (``train_runtime``, ``train_loss``,
...) and reloads the best checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hookloop.compat.hf import flow
from hookloop.loop.parts import Parts
from hookloop.loop.schedule import Action, Schedule, abort, passed_through


class HFSchedule(Schedule):
    """HF's flow over the loop's boundaries (see the module doc)."""

    opens_every_epoch = True
    steps_partial_group = True
    ends_epochs_early = True

    def __init__(self, *, session: Any, logbook: Any, ctx: Any, **parts: Any) -> None:
        super().__init__(**parts)
        self.session, self.logbook, self.ctx = session, logbook, ctx

    def will_log(self) -> bool:
        """``ctx.state.will_log`` by HF's logging schedule: the steps strategy (the native
        schedule), the first step with ``logging_first_step``, an epoch's last step with
        the epoch strategy. A callback may still clear ``should_log``."""
        if super().will_log():
            return True
        args, st = self.session.args, self.progress
        if st.step == 1 and getattr(args, "logging_first_step", False):
            return True
        last_of_epoch = st.epoch_step == st.steps_per_epoch or (
            st.max_steps is not None and st.step >= st.max_steps
        )
        return flow.strategy(args, "logging_strategy") == "epoch" and last_of_epoch

    def plan_next(self) -> None:
        self.next_boundary = self.progress.step + 1  # HF looks at its flags after every step

    def budget_reason(self) -> str | None:
        return None  # the epoch's end decides, from should_training_stop

    def at_step_end(self) -> Iterator[Action]:
        """``_maybe_log_save_evaluate`` on the flags the handlers left set."""
        st, flags, session = self.progress, self.session.control, self.session
        requests = self.take_requests()  # native callbacks' requests join HF's flags
        yield from passed_through(requests)
        flags.should_log |= requests.log
        flags.should_evaluate |= requests.evaluate
        if flags.should_log and st.step > session.last_logged_step:
            yield "log", {}
        if flags.should_evaluate and self.has_eval:
            yield "evaluate", {}
        requests = requests.merge(self.take_requests())  # filed by log or eval handlers
        if requests.abort:
            yield abort(requests)
            return
        flags.should_save |= requests.save
        if flags.should_save and self.checkpointer.persistent is not None:
            yield "save", {}
        if flags.should_training_stop and st.stop_reason is None:
            at_budget = st.max_steps is not None and st.step >= st.max_steps
            reason = "max_steps" if at_budget else requests.stop or "should_training_stop"
            yield "stop", {"reason": reason, "failed": requests.failed}
            return
        reason = self.stop_reason(requests) if st.stop_reason is None else None
        if reason is not None:
            yield "stop", {"reason": reason, "failed": requests.failed}

    def closes_epoch(self, ended: str) -> bool:
        """HF ends every epoch it leaves (a partial one too), unless an abort ended it."""
        return not (self.progress.stop_reason or "").startswith("abort")

    def evaluates_before_epoch_end(self) -> bool:
        return False  # DefaultFlowCallback asks in on_epoch_end; the epoch's end evaluates

    def advances_epoch(self, ended: str) -> bool:
        st = self.progress
        complete = ended == "exhausted" or st.epoch_step == st.steps_per_epoch
        return complete or (self.session.control.should_epoch_stop and ended != "stopped")

    def at_epoch_end(self) -> Iterator[Action]:
        """The epoch's log, evaluation and save, then the budget."""
        st = self.progress
        yield from self.at_step_end()
        if st.stop_reason is None and st.num_epochs is not None and st.epoch >= st.num_epochs:
            yield "stop", {"reason": "max_epochs"}
        if st.stop_reason is None and st.max_steps is not None and st.step >= st.max_steps:
            yield "stop", {"reason": "max_steps"}

    def epoch_stop(self) -> bool:
        return bool(self.session.control.should_epoch_stop)

    def finish(self) -> None:
        """HF's end of training: the summary log, the best checkpoint's weights when
        ``load_best_model_at_end``, and with ``save_total_limit=1`` the best folder alone."""
        self.logbook.summary()
        self.session.load_best_model(self.ctx)
        self.session.prune_after_training()


def schedule_of(p: Parts, *, session: Any) -> Schedule:
    """The dialect's schedule (the ``Dialect.schedule`` factory)."""
    return HFSchedule(
        session=session,
        logbook=p.logbook,
        ctx=p.ctx,
        config=p.config.train,
        progress=p.progress,
        control=p.control,
        signals=p.signals,
        device=p.device,
        has_eval=p.loaders.eval is not None,
        checkpointer=p.checkpointer,
    )
