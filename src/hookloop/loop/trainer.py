"""The training loop.

Read it top to bottom: ``train()`` → ``_run_epoch()`` → ``_run_steps()`` →
``_train_step()``, then ``act()`` on the plan the schedule makes at each step's end.
The loop owns every decision (when to log, evaluate, save, stop) through its
schedule, which it asks one question at each boundary; callbacks observe through
``ctx`` and ask through ``ctx.control``.
Switch every callback off and the model still trains.

The loop is composed of parts, built once by :func:`hookloop.loop.parts.build_parts`:
the :class:`~hookloop.loop.stepper.Stepper` (micro-steps, gradients, the update), the
:class:`~hookloop.loop.schedule.Schedule` (what is due, requests agreed across ranks,
exit conditions), the :class:`~hookloop.loop.logbook.LogBook` (the log event), the
:class:`~hookloop.loop.evaluation.Evaluation` and the
:class:`~hookloop.checkpoint.checkpointer.Checkpointer`. A dialect (transformers'
Trainer) runs this same loop with parts of its own.

Hot-path rules: events are fired only when someone handles them (the payload is not
even built otherwise); loss, grad norm and finiteness stay tensors and are read back
to the host only on log steps, except the single finiteness check that
``train.skip_nonfinite`` asks for.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.config import Config, TrainConfig
from hookloop.data import one_ahead, release_at
from hookloop.loop.actions import handler_of
from hookloop.loop.inputs import Inputs, as_config, as_manager, check_flops, check_inputs
from hookloop.loop.parts import Dialect, build_parts, checkpoint_managers
from hookloop.loop.pause import hold
from hookloop.loop.schedule import EpochEnd
from hookloop.manager import CallbackManager
from hookloop.result import TrainResult, is_abort
from hookloop.rundir import RunDir
from hookloop.runlock import lock_run
from hookloop.step import batch_size_of

__all__ = ["Trainer"]


class Trainer:
    """Runs training, evaluation and testing for a model, firing events as it goes.

    ``config`` may be a full :class:`~hookloop.config.Config` or just its
    :class:`~hookloop.config.TrainConfig`. ``train_data`` may be a dataset (any object
    with ``__getitem__`` and ``__len__`` but a list or tuple: a torch ``Dataset``, a
    ``datasets.Dataset``), batched by ``data.batch_size`` in a resumable, seeded loader
    with ``collate_fn`` (default: :func:`hookloop.data.collate_rows`); or a DataLoader,
    a list or any iterable of batches (one that yields single rows is refused). Give
    ``forward_step(state, data_iterator, model)`` for full control, or
    ``loss_fn(outputs, targets)`` for ``(inputs, targets)`` batches, or neither when the
    model returns its own loss. ``optimizer`` may be a function of the model that makes
    one (called once the model is placed; None: ``config.optimizer``), ``scheduler`` a
    function of the optimizer (None: ``config.scheduler``). ``out_dir`` is the run
    directory (checkpoints and the loggers' files); ``resume`` is ``"auto"`` or a
    checkpoint path. ``dialect`` replaces parts of the loop (see
    :class:`~hookloop.loop.parts.Dialect`). The bare loop adds no callbacks:
    :class:`hookloop.trainer.Trainer` adds the run's defaults.

    Public attributes: ``model`` (never wrapped), ``optimizer``, ``scheduler``,
    ``config``, ``callbacks`` (the manager), ``state`` (read-only counters; the loop
    writes them in ``progress``), ``control``, ``ctx``, ``device``, ``precision``,
    ``train_loader`` / ``eval_loader`` / ``test_loader``, ``flops_per_sample``,
    ``non_loss_data_func``, ``out_dir``, ``resume``, ``checkpoints`` (a
    CheckpointManager, or None without ``out_dir`` and ``resume``), and the parts:
    ``stepper``, ``schedule``, ``logbook``, ``evaluation``, ``checkpointer``.
    Callbacks read the run's facts from ``ctx.run``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], Any] | None = None,
        *,
        train_data: Iterable[Any] | None = None,
        eval_data: Iterable[Any] | None = None,
        test_data: Iterable[Any] | None = None,
        config: Config | TrainConfig | None = None,
        callbacks: CallbackManager | Callback | Iterable[Callback] | None = None,
        forward_step: Any = None,
        loss_fn: Any = None,
        scheduler: Any = None,
        out_dir: str | Path | None = None,
        resume: str | None = None,
        flops_per_sample: float | None = None,
        non_loss_data_func: Any = None,
        dialect: Dialect | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        check_inputs(model, optimizer, forward_step, loss_fn, non_loss_data_func)
        config = as_config(config).validate()
        # A figure in the config is the user's own: it wins over the recipe's estimate.
        self.flops_per_sample = check_flops(config.train.flops_per_sample or flops_per_sample)
        manager = as_manager(callbacks)
        manager.check_requirements()
        given = Inputs(
            model=model,
            optimizer=optimizer,
            data=(train_data, eval_data, test_data),
            config=config,
            callbacks=manager,
            forward_step=forward_step,
            loss_fn=loss_fn,
            scheduler=scheduler,
            out_dir=None if out_dir is None else str(out_dir),
            resume=resume,
            non_loss_data_func=non_loss_data_func,
            collate_fn=collate_fn,
        )
        p, schedule = build_parts(given, dialect)
        self.parts = p
        self.config, self.callbacks, self.ctx = config, manager, p.ctx
        self.progress, self.state, self.control = p.progress, p.state, p.control
        self.model, self.optimizer = p.model, p.optimizer
        self.stepper, self.schedule, self.logbook = p.stepper, schedule, p.logbook
        self.evaluation, self.checkpointer = p.evaluation, p.checkpointer
        self.resume = resume
        self.ctx.trainer = self
        self.actions = self._actions()
        p.fire("on_init_end")

    # -- what callbacks and users read ---------------------------------------------
    @property
    def scheduler(self) -> Any:
        """The LR scheduler (None: a constant rate)."""
        return self.parts.scheduler

    @property
    def device(self) -> torch.device:
        return self.parts.device

    @property
    def precision(self) -> Any:
        """fp32, bf16 or fp16: autocast and the gradient scaler (:mod:`hookloop.precision`)."""
        return self.parts.precision

    @property
    def train_loader(self) -> Iterable[Any] | None:
        return self.parts.loaders.train

    @property
    def eval_loader(self) -> Iterable[Any] | None:
        return self.parts.loaders.eval

    @property
    def test_loader(self) -> Iterable[Any] | None:
        return self.parts.loaders.test

    @property
    def out_dir(self) -> str | None:
        return self.parts.out_dir

    @property
    def checkpoints(self) -> Any:
        """The run's CheckpointManager (None: the run writes no checkpoints)."""
        return self.checkpointer.persistent

    @property
    def local_checkpoints(self) -> Any:
        return self.checkpointer.local

    @property
    def non_loss_data_func(self) -> Callable[[Any], Any] | None:
        """``non_loss_data_func(model)``, run after each evaluation and test (Megatron's)."""
        return self.evaluation.non_loss_data_func

    @non_loss_data_func.setter
    def non_loss_data_func(self, fn: Callable[[Any], Any] | None) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"non_loss_data_func must be callable(model), got {fn!r}")
        self.evaluation.non_loss_data_func = fn

    # -- training ------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Train until the step/epoch budget, a stop request, a signal or an exit condition.

        While it runs, the run directory is locked against a second writer.
        """
        if self.train_loader is None:
            raise ValueError("train() needs train_data; pass it to Trainer(train_data=...)")
        with lock_run(self._run_dir(), self.progress.rank, self.progress.world_size):
            return self._train()

    def _train(self) -> TrainResult:
        cfg, st, p = self.config.train, self.progress, self.parts
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        st.start_training()
        self.schedule.begin()
        restore_signals = p.signals.install() if cfg.handle_signals else None
        try:
            p.watchdog.start()  # several ranks: one that hangs is named, not waited for
            if self.resume is not None and self.checkpoints is not None:
                rng = self.checkpointer.contents.rng
                rng.hold = p.dialect.rng_after_first_fetch  # released in _run_epoch
                try:
                    self.checkpointer.resume(self.resume)
                finally:
                    rng.hold = False
            # to the optimizer trained with now, its groups as restored (fused or not)
            self.stepper.bind()
            self.logbook.device_skip = self.stepper.device_skip  # its skips counted at each log
            # live changes past the restored step, or those of the run --replay names
            p.live.plan_replays(p.live.replay_from, fresh=self.resume is None)
            p.fire("on_data_init_start")  # model, optimizer, checkpoint ready; no data read
            self.model.train()
            st.set_in_training(True)  # evaluations from here on are part of training
            p.fire("on_train_start")
            p.gc.begin()  # train.gc_every: collect on the loop's schedule from here on
            while st.stop_reason is None:
                if st.num_epochs is not None and st.epoch >= st.num_epochs:
                    st.stop("max_epochs")
                    break
                self._run_epoch()
            self._end_training()
        except BaseException as exc:
            p.watchdog.stop(exc)  # this rank failed on its own: the others are not told it hangs
            self.checkpointer.finish_quietly()  # any exit waits for the checkpoint being written
            self.callbacks.fire_exception(self.ctx, exc)
            self.ctx.clear_event_fields()  # nothing stale for a later evaluate() or test()
            raise
        finally:
            p.watchdog.stop()  # a "finished" beat: a rank done before the others is not hung
            self.stepper.release()  # a finished Trainer holds no autograd graph
            self.checkpointer.close()
            p.gc.end()
            st.set_in_training(False)
            if restore_signals:
                restore_signals()
        return TrainResult(
            step=st.step,
            epoch=st.epoch,
            stop_reason=st.stop_reason or "finished",
            signal=p.signals.caught,
            failed=st.failed,
            metrics=dict(st.last_eval),
            logs=dict(self.logbook.last_logs),
        )

    def _end_training(self) -> None:
        """After the last step: tokens counted, the schedule's finish, the last save (not
        after an abort) and its event, then ``on_train_end``."""
        st = self.progress
        self.logbook.sync_tokens()
        self.stepper.settle()
        self._check_skipped()
        if not is_abort(st.stop_reason):
            self.schedule.finish()
        if self.checkpointer.due_at_end(st.stop_reason):
            self.checkpointer.save()
        self.checkpointer.collect(wait=True)  # the last commit and its event before the end
        self.parts.fire("on_train_end")

    def _run_epoch(self) -> None:
        """One pass over the training data (or what is left of it after a resume)."""
        st, p, schedule = self.progress, self.parts, self.schedule
        rng = self.checkpointer.contents.rng  # a resume's generators the dialect held back
        if rng.held is not None and st.epoch_step == 0:
            rng.release()
        held = rng.held is not None
        batches = p.rewinder.reposition(  # less what rewinds skipped in it
            p.position.epoch(st.epoch, st.epoch_step, rng_held=held), st.epoch, self.train_loader
        )
        if p.dialect.fetch_ahead:
            batches = one_ahead(batches)
        if held:
            batches = release_at(batches, self.config.train.grad_accum, rng.release)
        if schedule.opens_epoch():
            p.fire("on_epoch_start")
        plan = schedule.at_epoch_end(self._run_steps(batches))
        if plan.stop_reason is not None:
            st.stop(plan.stop_reason)  # the step budget is spent
        if not plan.closes:
            return  # stopped mid-epoch: no epoch-end events
        if plan.evaluates_first:
            self._evaluate_in_training()
        p.fire("on_epoch_end")
        if plan.advances:
            st.next_epoch()
        self.act(plan.actions)

    def _run_steps(self, batches: Iterator[Any]) -> EpochEnd:
        """Steps until something ends them; returns what (an :class:`EpochEnd`)."""
        st, p, k = self.progress, self.parts, self.config.train.grad_accum
        schedule, control, checkpointer = self.schedule, self.control, self.checkpointer
        signals = p.signals
        clock, data_timer, rewinder, gc = p.clock, p.timers["data-iterator"], p.rewinder, p.gc
        partial_ok, epoch_stop = schedule.flow.steps_partial_group, schedule.flow.epoch_stop
        while True:
            if st.max_steps is not None and st.step >= st.max_steps:
                return EpochEnd.BUDGET
            fetching = clock()
            if rewinder.pending and rewinder.skip_due(st.step):
                rewinder.skip(batches, st.epoch)  # the data after a divergence
            group = list(itertools.islice(batches, k))
            data_timer.add(clock() - fetching)
            if len(group) < k and not (partial_ok and group):
                return EpochEnd.EXHAUSTED  # the data ran out; a partial group is dropped
            self._train_step(group)
            if gc.every is not None:
                gc.after_step(st.step)
            # The step's end has work only when something is due on the schedule, or a
            # request, a signal or a finished background save waits.
            if (
                st.step >= schedule.next_boundary
                or st.will_log
                or control.pending
                or signals.caught is not None
                or checkpointer.busy
            ):
                if checkpointer.busy:  # a background save that has committed: its event now
                    checkpointer.collect(wait=False)
                if self.act(schedule.at_step_end()):
                    return EpochEnd.STOPPED
            if epoch_stop is not None and epoch_stop():
                return EpochEnd.EPOCH_STOP
            if len(group) < k:
                return EpochEnd.EXHAUSTED

    def _train_step(self, group: list[Any]) -> None:
        """One optimizer step over the micro-batches of ``group``, firing its events."""
        st, ctx, hooks, stepper = self.progress, self.ctx, self.callbacks.index, self.stepper
        st.begin_step()
        self.control.skip_requested = False  # one filed after last step's update: not this one
        st.plan_log(self.schedule.will_log())
        per_rank = batch_size_of(group[0]) if len(group) == 1 else sum(map(batch_size_of, group))
        samples = per_rank * st.world_size
        flops = self.flops_per_sample * samples if self.flops_per_sample else 0.0
        st.consume(samples, flops)
        if st.step in self.schedule.skip_steps:
            return  # train.iterations_to_skip: data consumed, nothing computed
        st.open_update(samples, flops)  # until the update: a save records the step before
        if hooks["on_train_step_start"]:
            self.callbacks.fire("on_train_step_start", ctx)
        stepper.forward_backward(group)  # fires on_micro_step_start / _end per micro-batch
        loss_dict, grad_norm = stepper.prepare()  # unscale, normalise by tokens, clip
        ctx.loss_dict, ctx.grad_norm = loss_dict, grad_norm
        if hooks["on_before_optimizer_step"]:
            self.callbacks.fire("on_before_optimizer_step", ctx)
        skipped = stepper.update(loss_dict, grad_norm)  # or skip it; scheduler; clear grads
        st.close_update()
        self.logbook.add_step(
            loss_dict, grad_norm, stepper.skip_flag if stepper.skip_flag is not None else skipped,
            stepper.tokens, stepper.zeros,
        )  # fmt: skip
        ctx.skipped_iter = skipped
        if hooks["on_after_optimizer_step"]:
            self.callbacks.fire("on_after_optimizer_step", ctx)
        if hooks["on_train_step_end"]:
            self.callbacks.fire("on_train_step_end", ctx)
        ctx.loss_dict = ctx.grad_norm = ctx.skipped_iter = None

    # -- acting on a plan: one handler per kind of request ---------------------------
    def act(self, plan: Iterable[tuple[str, dict[str, Any]]]) -> bool:
        """Carry out a schedule's plan in its order, one handler per kind: the loop's own
        (``self.actions``), or the one registered for a kind added to the request
        vocabulary (:mod:`hookloop.loop.actions`). Returns True when training leaves the
        epoch: it stopped (a stop, an abort, a failed rewind) or rolled back."""
        actions, rewound, settled = self.actions, False, False
        for kind, values in plan:
            if not settled:  # the device's skips counted before anything acts on the counts
                if kind != "log":  # (a log counts them with its own read)
                    self.stepper.settle()
                settled = True
            own = actions.get(kind)
            if own is not None:
                own(values)
            else:
                handler_of(kind)(self, values)
            rewound = rewound or kind == "rewind"
        pause = self.parts.live.pauses.take() if self.progress.stop_reason is None else None
        if pause is not None:
            hold(self, pause)  # after the plan: until a resume
        return rewound or self.progress.stop_reason is not None

    def _actions(self) -> dict[str, Callable[[dict[str, Any]], object]]:
        """The loop's own handler of each kind of action (what it returns is not used)."""
        return {
            "log": lambda values: self.logbook.log(),
            "evaluate": lambda values: self._evaluate_in_training(),
            "save": lambda values: self.checkpointer.save(),
            "save_local": lambda values: self.checkpointer.save_local(),
            "rewind": self._rewind,
            "set": self._set,
            "unset": lambda values: self.parts.live.later.unset(values),
            "pause": lambda values: self.parts.live.pauses.ask(values),  # held below
            "resume": lambda values: self.parts.live.pauses.cancel(),  # none is held now
            "stop": self._stop,
            "abort": lambda values: self._stop({**values, "reason": f"abort: {values['reason']}"}),
        }

    def _rewind(self, values: dict[str, Any]) -> None:
        self.checkpointer.rewind(values["request"])
        self.parts.live.plan_replays(self.parts.live.replay_from)  # past the step rewound to

    def _set(self, values: dict[str, Any]) -> None:
        """A live ``set`` (:mod:`hookloop.loop.live`): applied, recorded, announced."""
        changes = self.parts.live.apply(values)
        if changes and self.callbacks.index["on_settings_change"]:
            self.ctx.changes = tuple(changes)
            try:
                self.callbacks.fire("on_settings_change", self.ctx)
            finally:
                self.ctx.changes = None

    def _stop(self, values: dict[str, Any]) -> None:
        """A stop or an abort (which saves nothing at the end) sets why training ends."""
        self.progress.stop(values["reason"], failed=bool(values.get("failed")))

    def _check_skipped(self) -> None:
        """A run whose steps were mostly skipped (NaN/Inf) did not train: it failed."""
        limit, st = self.config.train.max_skipped_fraction, self.progress
        if limit is None or st.failed or not st.step or st.skipped_steps <= limit * st.step:
            return
        st.stop(
            f"failed: {st.skipped_steps} of {st.step} steps skipped (more than "
            f"train.max_skipped_fraction={limit})",
            failed=True,
        )

    # -- evaluation, test, prediction -------------------------------------------------
    def _evaluate_in_training(self) -> None:
        gc, timer = self.parts.gc, self.parts.timers["eval"]
        timer.start()
        gc.at_eval()  # train.gc_every with gc_eval: the evaluation's garbage goes at once
        self.evaluate()
        gc.at_eval()
        timer.stop()
        self.model.train()

    def evaluate(self, data: Iterable[Any] | None = None) -> dict[str, float]:
        """Average the loss (and meta metrics) over evaluation data; keys are ``eval_*``."""
        loader = self.parts.open_loader(data, False) if data is not None else self.eval_loader
        if loader is None:
            raise ValueError(
                "evaluate() needs eval data: pass eval_data to Trainer or to evaluate()"
            )
        return self.evaluation.run(loader, "eval")

    def test(self, data: Iterable[Any] | None = None) -> dict[str, float]:
        """Like ``evaluate()`` on test data, firing the ``on_test_*`` events; keys ``test_*``."""
        loader = self.parts.open_loader(data, False) if data is not None else self.test_loader
        if loader is None:
            raise ValueError("test() needs test data: pass test_data to Trainer or to test()")
        return self.evaluation.run(loader, "test")

    def predict(self, data: Iterable[Any]) -> list[Any]:
        """Forward only; collect whatever ``loss_func`` returns (the inference pattern)."""
        loader = self.parts.open_loader(data, False)
        if loader is None:
            raise ValueError("predict() needs data: an iterable of batches, got None")
        return self.evaluation.predict(loader)

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of this exact state now (see ``Checkpointer.save``)."""
        return self.checkpointer.save()

    def load_checkpoint(self, target: str) -> Path | None:
        """Restore from ``"auto"`` or a checkpoint path, firing ``on_checkpoint_load``."""
        return self.checkpointer.resume(target)

    def resume_from(self, target: str) -> None:
        """Resume from ``target`` (``"auto"`` or a checkpoint path) when ``train()`` starts;
        a run built without ``out_dir`` goes on saving in the run ``target`` belongs to."""
        self.resume = target
        if self.checkpoints is None:
            stores = checkpoint_managers(self.config, self.parts.dialect, self.out_dir, target)
            self.checkpointer.attach(*stores)

    def _run_dir(self) -> RunDir | None:
        """The run directory train() locks: ``out_dir``, or the one the checkpoints are in."""
        if self.ctx.run.dir is not None:
            return self.ctx.run.dir
        return RunDir.of_checkpoint(self.checkpoints.storage.root) if self.checkpoints else None
