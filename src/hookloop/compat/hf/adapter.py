"""The adapter: HF-style callbacks run as native hookloop callbacks.

One :class:`HFSession` per trainer holds the dialect's ``args``, ``state`` and
``control``. Each HF callback becomes one native callback (an adapter) whose
``on_<native>`` handlers call the dialect handlers that
:func:`hookloop.compat.mapping.dialect_events` lists for that native event, then
turn the control flags a handler switched on into native requests. Two more
native callbacks of the session run first and last at every event they handle:
the first applies HF's flag resets and keeps ``log_history``; the last updates
``best_metric`` after every ``on_evaluate`` handler has seen the previous one.

Which methods are handlers, and how each is called: :mod:`hookloop.compat.hf.calling`.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookloop.callback import Callback
from hookloop.compat._toolkit import (
    DialectAdapter,
    adapt,
    as_list,
    is_stateful,
    label,
)
from hookloop.compat.hf import calling, console, flow, layout, results
from hookloop.compat.hf.handler import instance, is_exportable
from hookloop.compat.hf.plain_args import PlainTrainingArguments
from hookloop.compat.hf.switches import InputTokens
from hookloop.compat.hf.types import (
    CONTROL_FLAGS,
    TrainerControl,
    TrainerState,
    eval_key,
)
from hookloop.compat.mapping import dialect_events
from hookloop.result import is_abort
from hookloop.state import CallbackContext

# transformers' own logger: its verbosity settings (and log_level) govern these messages
logger = logging.getLogger("transformers.trainer")

#: native event -> the HF events it fires, in order (read from the one table).
NATIVE_TO_HF = dialect_events("hf")

#: Native events inside an optimizer step, before it counts as done: HF's
#: ``global_step`` there is one less than the native ``state.step``.
_INSIDE_STEP = frozenset(
    {
        "on_train_step_start",
        "on_micro_step_start",
        "on_micro_step_end",
        "on_before_optimizer_step",
        "on_after_optimizer_step",
    }
)

_FIRST = -(10**9)  # the session's bookkeeping runs before every other handler ...
_LAST = 10**9  # ... and its best-metric update after every other handler


class HFSession:
    """The dialect objects shared by every HF callback of one trainer.

    ``args`` may be our :class:`TrainingArguments`, a ``transformers``
    ``TrainingArguments``, or ``None`` to derive it from the trainer's config
    when the trainer is built.
    """

    def __init__(self, args: Any = None, *, processing_class: Any = None) -> None:
        if args is not None and not hasattr(args, "metric_for_best_model"):
            raise TypeError(
                "args must be a TrainingArguments (hookloop.compat.hf or transformers) or "
                f"None to derive it from the hookloop Config, got {type(args).__name__}"
            )
        self.args = args
        self.state = TrainerState()
        self.control = TrainerControl()
        self.processing_class = processing_class
        self.data_collator: Any = None  # the Trainer's, whose tokenizer a checkpoint may save
        self.kwargs: dict[str, Any] | None = None  # the common kwargs, once bound
        self._bookkeeping: list[Callback] | None = None
        self._warned_epoch_stop = False
        # Set by the dialect Trainer when TrainingArguments decide the run: then HF's
        # flags decide every log, evaluation and save (hookloop.compat.hf.flow), and
        # the bookkeeping below is what the loop reads.
        self.drives_loop = False
        self.members: list[Any] = []  # the callbacks as given (HF-style or native), in order
        self.native_of: dict[int, Callback] = {}  # id(member) -> what the manager runs
        self.trainer: Any = None  # what handlers get as ``trainer=`` (the dialect Trainer)
        self.summary: dict[str, Any] = {}  # HF's end-of-training log, once written
        self.last_logged_step = 0
        self.last_checkpoint: Any = None
        self.total_loss = 0.0
        self.train_start = 0.0
        self.first_step = 0
        self.first_samples = 0
        #: HF's count of the run's samples (its throughput's numerator), from the budget
        self.train_samples: float | None = None
        self._eval_start = 0.0
        #: transformers' ``model_preparation_time``: set by an evaluation before any
        #: training (the model is prepared then), and reported by every one after it
        self.model_preparation_time: float | None = None
        self.trained = False
        self.evaluating = False  # inside evaluate(): Trainer.log leaves the metrics to on_eval_end
        self.before_summary: Callable[[dict[str, Any]], None] | None = None  # adds to the summary
        self.loss_poisoned = False  # a logged loss was NaN/Inf (see HFLogBook.log)
        #: include_num_input_tokens_seen's counter (None: not counted); see switches.py
        self.tokens: InputTokens | None = None
        #: eval_on_start's evaluation, run after every on_train_begin handler (None: off)
        self.evaluate_at_start: Callable[[], None] | None = None
        self.evaluating_at_start = False  # that evaluation sets no best metric
        #: the per-device batch auto_find_batch_size settled on (None: the arguments')
        self.train_batch_size: int | None = None
        self.foreign_step: int | None = None  # resumed from transformers' own checkpoint-N
        # HF's compute_metrics(EvalPrediction): predictions and labels of one evaluation
        self.compute_metrics: Callable[[Any], dict[str, Any]] | None = None
        self.metrics_of: Callable[[], Any] | None = None  # read at each evaluation's start
        self._predictions: list[Any] = []
        self._labels: list[Any] = []

    # -- wrapping --------------------------------------------------------------
    def wrap(self, callbacks: Any) -> list[Callback]:
        """Native callbacks for a list mixing HF-style and native ones (order kept).

        The session's own two bookkeeping callbacks come with the first call.
        """
        items = as_list(callbacks)
        wrapped = []
        for item in items:
            native = self._wrap_one(item)
            member = getattr(native, "hf_callback", native)
            self.members.append(member)
            self.native_of[id(member)] = native
            wrapped.append(native)
        if self._bookkeeping is None:
            self._bookkeeping = [_SessionFirst(self), _SessionLast(self)]
            wrapped = [self._bookkeeping[0], *wrapped, self._bookkeeping[1]]
        return wrapped

    def _wrap_one(self, item: Any) -> Callback:
        item = instance(item)  # as in transformers: an HF callback class is instantiated
        if isinstance(item, Callback):
            return item
        handlers = calling.handled_events(item)
        if not handlers and not calling.is_hf_callback(item):
            raise TypeError(
                f"{type(item).__name__} is neither a hookloop Callback nor an HF-style callback "
                f"(an object with handlers named {', '.join(calling.HF_EVENTS[:3])}, ...)"
            )
        calls = {event: calling.caller(getattr(item, event), event, item) for event in handlers}
        natives = [native for native, hf in NATIVE_TO_HF.items() if calls.keys() & set(hf)]
        return adapt(_HFAdapter, item, natives, self, calls, self._state_key(item))

    def _state_key(self, item: Any) -> str:
        """The name ``item``'s ``state_dict`` is checkpointed under: its label, and for a
        second (third, ...) stateful callback with that label ``label#2`` (``#3``, ...),
        so several instances of one class each resume their own state (the numbers
        follow the order the callbacks are given in, as a resumed run gives them)."""
        own = label(item)
        if not is_stateful(item):
            return own
        taken = {n.name for n in self.native_of.values() if is_stateful(n)}
        n, key = 1, own
        while key in taken:
            n += 1
            key = f"{own}#{n}"
        return key

    def unwrap(self, member: Any) -> Callback:
        """Forget a member (an HF-style or native callback); returns its native callback."""
        self.members = [m for m in self.members if m is not member]
        return self.native_of.pop(id(member))

    # -- HF's stateful callbacks (ExportableState) and TrainerControl ----------------
    def export_callbacks(self) -> dict[str, Any]:
        """``TrainerState.stateful_callbacks`` as HF writes it: class name -> state
        (a list of states for several instances of one class)."""
        out: dict[str, Any] = {}
        for cb in [*self.members, self.control]:
            if cb is not self.control and not is_exportable(cb):
                continue
            name, data = type(cb).__name__, cb.state()
            if name not in out:
                out[name] = data
            elif isinstance(out[name], list):
                out[name].append(data)
            else:
                out[name] = [out[name], data]
        return out

    def restore_callbacks(self) -> None:
        """HF's ``_load_callback_state``: only with
        ``restore_callback_states_from_checkpoint``; each saved state goes, by class
        name and in order, to the callbacks of that class (rebuilt from the saved
        constructor arguments, then the saved attributes), and the control's flags."""
        if not getattr(self.args, "restore_callback_states_from_checkpoint", False):
            return
        present = [*self.members, self.control]
        missing = []
        for name, data in (self.state.stateful_callbacks or {}).items():
            same = [cb for cb in present if type(cb).__name__ == name]
            if not same:
                missing.append(name)
            for cb, saved in zip(same, data if isinstance(data, list) else [data], strict=False):
                _rebuild_in_place(cb, saved)
        if missing:
            logger.warning(
                "The checkpoint holds the state of callbacks this trainer does not have; "
                f"ignored: {', '.join(missing)}"
            )

    # -- the dialect view, kept current ----------------------------------------
    def bind(self, ctx: CallbackContext) -> None:
        """Fill ``args`` and the common kwargs from the run (once).

        The facts come from ``ctx.run``; the dataloaders and the trainer are the
        objects HF hands its callbacks, so they are the Trainer's public ones.
        """
        run, loop = ctx.run, ctx.trainer
        trainer = self.trainer if self.trainer is not None else loop
        if self.args is None:
            self.args = PlainTrainingArguments.from_config(
                ctx.config,
                output_dir=str(run.dir.root) if run.dir is not None else None,
                has_eval_data=run.has_eval_data,
            )
        self.kwargs = {
            "model": ctx.model,
            "processing_class": self.processing_class,
            "optimizer": ctx.optimizer,
            "lr_scheduler": ctx.scheduler,
            "train_dataloader": loop.train_loader if loop is not None else None,
            "eval_dataloader": loop.eval_loader if loop is not None else None,
            "trainer": trainer,
        }
        self.set_budget(ctx)

    def refresh(self, ctx: CallbackContext, native_event: str) -> None:
        if self.kwargs is None:
            self.bind(ctx)
        self.state.refresh(ctx.state, inside_step=native_event in _INSIDE_STEP)
        if self.tokens is not None:  # counted here, not by the native loop
            self.state.num_input_tokens_seen = self.tokens.seen()

    def set_budget(self, ctx: CallbackContext) -> None:
        """The state's fields fixed for a run, with the batch size trained with."""
        self.state.set_budget(ctx.state, self.args)
        if self.train_batch_size is not None:
            self.state.train_batch_size = self.train_batch_size

    def apply(self, before: tuple[bool, ...], ctx: CallbackContext, who: str) -> None:
        """File a native request for each flag a handler switched on."""
        control, native = self.control, ctx.control
        turned_on = {
            name
            for name, was, now in zip(CONTROL_FLAGS, before, control.flags(), strict=True)
            if now and not was
        }
        if not turned_on:
            return
        if "should_abort_without_save" in turned_on:
            native.request_abort(f"{who} set should_abort_without_save")
        elif "should_training_stop" in turned_on:
            native.request_stop(f"{who} set should_training_stop")
        if self.drives_loop:
            return  # the loop reads should_save / should_evaluate / should_log itself
        if "should_save" in turned_on:
            native.request_save()
        if "should_evaluate" in turned_on:
            native.request_evaluate()
        if "should_log" in turned_on:
            native.request_log()
        self._warn_epoch_stop(turned_on, who)

    def _warn_epoch_stop(self, turned_on: set[str], who: str) -> None:
        if "should_epoch_stop" in turned_on and not self._warned_epoch_stop:
            self._warned_epoch_stop = True
            warnings.warn(
                f"{who} set control.should_epoch_stop: hookloop does not end an epoch early, "
                "so it has no effect (set should_training_stop to end training)",
                stacklevel=2,
            )

    def load_best_model(self, ctx: CallbackContext) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights, before ``on_train_end``."""
        args, state = self.args, self.state
        if not getattr(args, "load_best_model_at_end", False):
            return
        if is_abort(ctx.state.stop_reason):
            return  # an abort keeps the weights as they are, as a crash would
        if state.best_model_checkpoint is None:
            warnings.warn(
                "load_best_model_at_end: no checkpoint was saved at the best evaluation step "
                f"({state.best_global_step}); keeping the final weights. Save at every "
                "evaluation step (save_steps a multiple of eval_steps) to have one.",
                stacklevel=2,
            )
            return
        from hookloop.entry import load_weights

        console.announce_best_model(state.best_model_checkpoint, state.best_metric)
        load_weights(ctx.model, layout.native_checkpoint(state.best_model_checkpoint))

    def prune_after_training(self) -> None:
        """HF's end of training with ``save_total_limit=1``: of the ``checkpoint-N``
        folders only the best is kept (hookloop's own checkpoints keep their retention)."""
        args, state = self.args, self.state
        output_dir = getattr(args, "output_dir", None)
        if getattr(args, "save_total_limit", None) != 1 or output_dir is None:
            return
        if state.best_model_checkpoint is None or results.world_rank() != 0:
            return
        layout.keep_only(output_dir, Path(state.best_model_checkpoint))

    def adopt(self, result: Any, who: str, event: str) -> None:
        """A handler may return an updated control: its flags become the session's."""
        if result is None or result is self.control:
            return
        if not hasattr(result, "should_training_stop"):
            raise TypeError(
                f"{who}.{event} returned {type(result).__name__}; an HF handler returns None "
                "or a TrainerControl"
            )
        for name in CONTROL_FLAGS:
            setattr(self.control, name, bool(getattr(result, name, False)))


class _HFAdapter(DialectAdapter):
    """One HF-style callback, seen by the engine as a native callback (built by
    :meth:`HFSession.wrap`). Forgather's ``state_dict``/``load_state_dict`` is
    checkpointed under ``name``; HF's ``ExportableState`` goes into
    ``TrainerState.stateful_callbacks`` instead."""

    built_by = "HFSession.wrap([callback])"

    def __init__(
        self, hf_callback: Any, session: HFSession, calls: dict[str, Any], key: str
    ) -> None:
        super().__init__(hf_callback)
        self.session = session
        self._calls = calls
        self._label = label(hf_callback)
        self._key = key
        priority = getattr(hf_callback, "priority", 50)
        self.priority = priority if isinstance(priority, int) else 50

    @property
    def hf_callback(self) -> Any:
        return self.wrapped

    @property
    def name(self) -> str:
        return self._key

    def __repr__(self) -> str:
        return f"HF({self._label})"

    def dispatch(self, native_event: str, ctx: CallbackContext) -> None:
        session = self.session
        session.refresh(ctx, native_event)
        for event in NATIVE_TO_HF[native_event]:
            call = self._calls.get(event)
            if call is None or (event == "on_substep_end" and calling.last_micro_step(ctx)):
                continue
            extra = calling.extra_kwargs(event, native_event, ctx, session.state)
            before = session.control.flags()
            result = call(session.args, session.state, session.control, {**session.kwargs, **extra})
            session.adopt(result, self._label, event)
            session.apply(before, ctx, self._label)


# -- HF's ExportableState -----------------------------------------------------------
def _rebuild_in_place(cb: Any, saved: dict[str, Any]) -> None:
    """``cb`` as ``type(cb)(**args)`` with the saved attributes; the object the user
    holds stays the one the trainer runs."""
    fresh = type(cb)(**saved.get("args", {}))
    vars(cb).update(vars(fresh))
    for name, value in saved.get("attributes", {}).items():
        setattr(cb, name, value)


# -- the session's own bookkeeping -----------------------------------------------
class _SessionPart(Callback):
    """A native callback of the session's own, under a fixed name."""

    label = ""

    def __init__(self, session: HFSession) -> None:
        self.session = session

    @property
    def name(self) -> str:
        return self.label


class _SessionFirst(_SessionPart):
    """HF's flag resets and log history, before any other handler of the event."""

    priority = _FIRST
    label = "hf.TrainerState"

    def on_init_end(self, ctx: CallbackContext) -> None:
        self.session.bind(ctx)

    def on_train_start(self, ctx: CallbackContext) -> None:
        self.session.trained = True
        self.session.loss_poisoned = False
        session = self.session
        session.refresh(ctx, "on_train_start")
        session.set_budget(ctx)
        if session.tokens is not None:  # the tokens per second count this train()'s
            session.tokens.at_train_start = session.tokens.seen()
        session.control.new_training()
        session.train_start = time.monotonic()
        session.first_step = session.last_logged_step = ctx.state.step
        session.first_samples = ctx.state.samples

    def on_epoch_start(self, ctx: CallbackContext) -> None:
        self.session.control.new_epoch()

    def on_train_end(self, ctx: CallbackContext) -> None:
        if not self.session.drives_loop:  # HF's flow reloads it before the summary log
            self.session.load_best_model(ctx)

    def on_train_step_start(self, ctx: CallbackContext) -> None:
        self.session.control.new_step()

    def on_log(self, ctx: CallbackContext) -> None:
        session = self.session
        session.refresh(ctx, "on_log")
        session.control.should_log = False
        session.state.log_history.append({**ctx.logs, "step": session.state.global_step})

    def on_eval_start(self, ctx: CallbackContext) -> None:
        session = self.session
        session._eval_start = time.monotonic()
        session._predictions, session._labels = [], []
        if session.metrics_of is not None:  # the Trainer's, as it is now (as transformers)
            session.compute_metrics = session.metrics_of()

    def on_eval_step_end(self, ctx: CallbackContext) -> None:
        session = self.session
        if session.compute_metrics is not None:
            session._predictions.append(_logits(ctx.outputs))
            session._labels.append(_labels(ctx.batch))

    def on_eval_end(self, ctx: CallbackContext) -> None:
        session = self.session
        session.refresh(ctx, "on_eval_end")
        if session.compute_metrics is not None and session._predictions:
            _add_computed_metrics(session, ctx.metrics)
        runtime = any(k.endswith("_runtime") for k in ctx.metrics)
        if session.drives_loop and not runtime:  # a native evaluation's: HF's speed keys
            batches = ctx.run.eval_batches or 0
            samples = batches * getattr(session.args, "per_device_eval_batch_size", 1)
            flow.eval_speed(ctx.metrics, time.monotonic() - session._eval_start, samples, batches)
        if session.drives_loop:
            session.control.should_log = False
        session.control.should_evaluate = False
        state = session.state
        state.log_history.append({**ctx.metrics, "epoch": state.epoch, "step": state.global_step})

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        """HF's ``_save_checkpoint``: the best checkpoint noted, then, when the dialect
        Trainer drives the run, HF's ``checkpoint-N/trainer_state.json`` written."""
        session = self.session
        state, output_dir = session.state, getattr(session.args, "output_dir", None)
        session.last_checkpoint = ctx.checkpoint_path
        hf_style = session.drives_loop and output_dir is not None
        where = layout.hf_folder(output_dir, ctx.state.step) if hf_style else ctx.checkpoint_path
        if state.best_global_step is not None and state.best_global_step == ctx.state.step:
            state.best_model_checkpoint = str(where)
        elif hf_style and state.best_global_step:
            # as HF: the best step's folder, saved earlier than its evaluation (an epoch's
            # evaluation after that step's save), is noted at the next save
            best = layout.hf_folder(output_dir, state.best_global_step)
            if best.is_dir():
                state.best_model_checkpoint = str(best)
        if hf_style:
            session.refresh(ctx, "on_checkpoint_save")
            state.stateful_callbacks = session.export_callbacks()  # should_save still set, as HF
            layout.write(output_dir, ctx.state.step, ctx.checkpoint_path, state, self._extras(ctx))
        session.control.should_save = False

    def _extras(self, ctx: CallbackContext) -> Any:
        """What writes transformers' own files into a ``checkpoint-N`` folder."""
        session = self.session
        return functools.partial(
            results.write_checkpoint_extras,
            model=ctx.model,
            scheduler=ctx.scheduler,
            args=session.args,
            processing_class=session.processing_class,
            data_collator=session.data_collator,
        )

    def state_dict(self) -> dict[str, Any]:
        session = self.session
        state, output_dir = session.state, getattr(session.args, "output_dir", None)
        if session.drives_loop and output_dir and state.best_global_step == state.global_step:
            # saved while this very checkpoint is the best: it must say so when resumed
            state.best_model_checkpoint = str(layout.hf_folder(output_dir, state.global_step))
        state.stateful_callbacks = session.export_callbacks()
        return {**session.state.resumable(), "stateful_callbacks": session.state.stateful_callbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        session = self.session
        session.state.restore(state)
        if session.tokens is not None:
            session.tokens.restore(session.state.num_input_tokens_seen)
        session.restore_callbacks()


class _SessionLast(_SessionPart):
    """After every ``on_evaluate`` handler: keep ``best_metric`` as HF's Trainer does."""

    priority = _LAST
    label = "hf.best_metric"

    def on_train_start(self, ctx: CallbackContext) -> None:
        if self.session.evaluate_at_start is not None:  # eval_on_start, after on_train_begin
            self.session.evaluate_at_start()

    def on_eval_end(self, ctx: CallbackContext) -> None:
        args, state = self.session.args, self.session.state
        if self.session.evaluating_at_start:  # as transformers: no best from eval_on_start
            return
        metric = getattr(args, "metric_for_best_model", None)
        if not metric or not ctx.metrics:
            return
        value = ctx.metrics.get(eval_key(metric))
        if value is None:
            return
        best = state.best_metric
        is_new_best = best is None or (value > best if args.greater_is_better else value < best)
        if is_new_best:
            state.best_metric = value
            state.best_global_step = ctx.state.step
        if ctx.state.in_training and flow.strategy(args, "save_strategy") == "best":
            self.session.control.should_save = is_new_best  # as HF: a save at each new best


# -- compute_metrics ---------------------------------------------------------------
class EvalPrediction:
    """HF's ``EvalPrediction``: ``predictions`` and ``label_ids`` (unpacks as a pair)."""

    def __init__(self, predictions: Any, label_ids: Any) -> None:
        self.predictions, self.label_ids = predictions, label_ids

    def __iter__(self) -> Any:
        return iter((self.predictions, self.label_ids))

    def __getitem__(self, i: int) -> Any:
        return (self.predictions, self.label_ids)[i]


def _logits(outputs: Any) -> Any:
    """The prediction part of a model's output (everything but the loss), as HF takes it."""
    if isinstance(outputs, dict):
        rest = [v for k, v in outputs.items() if k != "loss"]
        outputs = rest[0] if len(rest) == 1 else tuple(rest)
    elif isinstance(outputs, (tuple, list)) and len(outputs) > 1:
        outputs = outputs[1] if len(outputs) == 2 else tuple(outputs[1:])
    return outputs.detach().cpu() if hasattr(outputs, "detach") else outputs


def _labels(batch: Any) -> Any:
    if isinstance(batch, dict):
        labels = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        labels = batch[1]
    else:
        labels = None
    return labels.detach().cpu() if hasattr(labels, "detach") else labels


def _add_computed_metrics(session: HFSession, metrics: dict[str, Any]) -> None:
    """``compute_metrics`` on the whole evaluation; keys get HF's ``eval_`` prefix."""
    import torch

    def joined(parts: list[Any]) -> Any:
        return torch.cat([p if p.dim() else p.reshape(1) for p in parts])

    predictions = joined(session._predictions)
    labels = joined(session._labels) if all(x is not None for x in session._labels) else None
    computed = session.compute_metrics(  # type: ignore[misc]  # called only when set
        EvalPrediction(predictions.numpy(), None if labels is None else labels.numpy())
    )
    for key, value in computed.items():
        metrics[key if key.startswith("eval_") else f"eval_{key}"] = value
