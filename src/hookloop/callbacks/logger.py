"""The logger base: what every log backend needs from the loop, written once.

A log backend (JSON Lines, TensorBoard, W&B, a CSV file, a database) only has to
put records somewhere and take them back when the run goes back in time. Which
events make a record, which rank writes, when a resume or a rewind cuts the
log back, when the background writer is drained and the files synced, and how
the logged values are read off the device: :class:`Logger` does all of that, the
same for every backend, so a new backend cannot get it subtly wrong.

The contract, event by event (global rank 0 only; other ranks write nothing):

=========================  =============================================================
``on_train_start``         a ``start`` record (after a resume: cut back first, see below)
``on_log``                 a ``train`` record of ``ctx.logs``
``on_eval_end``            an ``eval`` record of ``ctx.metrics``; ``on_test_end``: ``test``
``on_checkpoint_load``     cut back to the restored step; after a rewind
                           (``ctx.rewind``, :mod:`hookloop.checkpoint.rewind`) a ``rewind`` record
``state_dict()``           the writer drained, the files flushed: :meth:`Logger.position`
``on_checkpoint_save``     the writer drained, the files flushed, then synced to disk
                           in the background
``on_train_end``           an ``end`` record, then the writer drained and the files closed
``on_exception``           the same, once training had started (``status`` failed or
                           interrupted, ``error``)
=========================  =============================================================

Resume: a checkpoint keeps :meth:`Logger.position`, taken once every record
handed over before it has been written. The resumed run gives it back to
:meth:`Logger.cut` with the step it restarts from, so a backend can cut exactly
(a byte offset) or by step. A resume whose checkpoint holds nothing for this
logger, or that found no checkpoint at all, cuts by step alone (``saved`` is
None). A rewind cuts the same way, in the running process.

Values: plain Python scalars (``int``, ``float``, ``str``, ``bool``, ``None``)
are handed to the writer thread as they are, so a log event costs the loop a
dict copy and a queue entry. A log holding anything else (a tensor a callback
put there) is read at once by :meth:`Logger.prepare`, while it holds this
step's value.
"""

from __future__ import annotations

import copy
import os
import socket
from abc import ABC, abstractmethod
from time import time as _now
from typing import Any

from hookloop.callback import Callback
from hookloop.callbacks._writer import log_writer
from hookloop.result import run_status
from hookloop.state import CallbackContext, TrainState

#: Record kinds, in the order a run writes them.
KINDS = ("start", "train", "eval", "test", "rewind", "end")


class Record:
    """What one event leaves in a log; handed to :meth:`Logger.write`, never changed after.

    ``kind`` is one of :data:`KINDS`; ``time`` is Unix seconds at the event; ``step``
    and ``epoch`` are the run's counters then (the epoch with its fraction done,
    :func:`epoch_of`). ``values``: for ``train`` the log's
    values (``loss``, ``lr``, ... and whatever producer callbacks added), for
    ``eval``/``test`` the metrics (``eval_loss``, ...); ``start``: ``pid``, ``host``,
    ``resumed``, ``max_steps``; ``rewind``: the :class:`~hookloop.state.Rewind`'s
    fields; ``end``: ``status``, ``stop_reason`` and, after an exception, ``error``.
    ``state``: for ``start`` and ``end``, a copy of the run's
    :class:`~hookloop.state.TrainState` at the event (budget, last evaluation, ...);
    None for the others.
    """

    __slots__ = ("epoch", "kind", "state", "step", "time", "values")

    def __init__(
        self,
        kind: str,
        step: int,
        epoch: float,
        time: float,
        values: dict[str, Any],
        state: TrainState | None = None,
    ) -> None:
        self.kind = kind
        self.step = step
        self.epoch = epoch
        self.time = time
        self.values = values
        self.state = state

    def __repr__(self) -> str:
        return f"Record({self.kind!r}, step={self.step}, epoch={self.epoch}, {self.values!r})"


class Logger(Callback, ABC):
    """Base class of log backends: owns the events, the resume and rewind cut, the flushes.

    A backend implements :meth:`write` and :meth:`cut`, and of the rest only what
    it has use for:

    ``write(record)``
        on the writer thread: put one :class:`Record` in the log.
    ``cut(step, saved)``
        drop what was written after ``step``; ``saved`` is what ``position()``
        returned for the checkpoint at ``step``, or None.
    ``position()``
        where the log stands (a byte offset, a run id), kept by a checkpoint
        (default ``{}``).
    ``sync(durable)``
        hand what was written to the OS; with ``durable`` (on the writer thread,
        after a checkpoint) to the disk too (default: nothing).
    ``release()``
        close files, finish a run; the next record opens them again (default:
        ``sync(False)``).
    ``open(ctx)``
        at train start, after any cut: open what needs the run's context, such as
        its config (default: nothing).
    ``prepare(values)``
        read values that are not plain scalars (default: numbers as floats,
        anything else as its string).

    All but ``write`` run on the loop's thread, and all but ``prepare`` and
    ``open`` once this logger's records are written, so a backend needs no lock.
    Records reach ``write`` in the order of the events, on the one thread all
    loggers share; the loop waits for it at a checkpoint, so it should be quick.
    Ranks other than 0 call ``release`` alone (at the end), and only ``open``
    sees the context: a record carries what it needs.

    A backend that keeps its records in a list, in about ten lines:

    >>> from hookloop import Config, DataConfig, TrainConfig, Trainer
    >>> from hookloop.callbacks.logger import Logger
    >>> from hookloop.testing import TinyModel, ToyData
    >>> class ListLogger(Logger):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.records = []
    ...     def write(self, record):
    ...         self.records.append((record.kind, record.step))
    ...     def cut(self, step, saved):
    ...         self.records = [r for r in self.records if r[1] <= step]
    >>> log = ListLogger()
    >>> config = Config(train=TrainConfig(max_steps=3, log_every=1, eval_every=2),
    ...                 data=DataConfig(batch_size=4))
    >>> _ = Trainer(TinyModel(), train_data=ToyData(n=16), eval_data=ToyData(n=8),
    ...             loss_fn=TinyModel.loss_fn, config=config, callbacks=[log]).train()
    >>> log.records
    [('start', 0), ('train', 1), ('train', 2), ('eval', 2), ('train', 3), ('end', 3)]

    A logger is stateful (its checkpoint entry is :meth:`position`, under its
    ``name``), and runs late (``priority`` 100: after every producer of log values).
    """

    priority = 100

    def __init__(self) -> None:
        self._background = log_writer()
        self._last_task = 0  # the number of this logger's latest task on the writer
        self._loaded: dict[str, Any] | None = None  # from load_state_dict, until the cut
        self._cut_before_start = False  # a checkpoint was loaded before on_train_start

    def burst_over(self) -> bool:
        """On the writer thread: whether the record being written is the last one handed
        over so far (a backend may then hand its file to the OS, once per burst)."""
        return self._background.idle()

    # -- what a backend implements ----------------------------------------------------
    @abstractmethod
    def write(self, record: Record) -> None:
        """On the writer thread: put ``record`` in the log."""

    @abstractmethod
    def cut(self, step: int, saved: dict[str, Any] | None) -> None:
        """Drop everything written after ``step``: a resume or a rewind restarts there.

        ``saved`` is what :meth:`position` returned when the checkpoint at ``step`` was
        taken, or None when the checkpoint had nothing for this logger (or there was no
        checkpoint: ``step`` is then where training restarts, usually 0).
        """

    def position(self) -> dict[str, Any]:
        """Where the log stands now, as plain data: a checkpoint keeps it for :meth:`cut`."""
        return {}

    def sync(self, durable: bool) -> None:
        """Hand what :meth:`write` wrote to the OS (a killed process keeps it); with
        ``durable`` (on the writer thread, after a checkpoint), to the disk as well."""

    def release(self) -> None:
        """Close what :meth:`write` opened; a later record opens it again."""
        self.sync(False)

    def open(self, ctx: CallbackContext) -> None:
        """At ``on_train_start``, after any cut, before the ``start`` record: open what needs
        the run's context (its config, its directory) on the loop's thread."""

    def prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        """Read values that are not plain Python scalars now, on the loop's thread, while a
        tensor still holds this step's number (plain ones are kept as they are)."""
        return {k: v if type(v) in _SCALARS else _read(v) for k, v in values.items()}

    # -- flushing ----------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every record handed over so far is written and with the OS."""
        self._background.wait(self._last_task)
        self.sync(False)

    def close(self) -> None:
        """Wait until every record handed over so far is written, then :meth:`release`."""
        try:
            self._background.wait(self._last_task)
        finally:
            self.release()

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.flush()  # the position counts every record handed over before the checkpoint
        return self.position()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the checkpoint's position: the cut follows at ``on_checkpoint_load``."""
        self._loaded = dict(state)

    def _cut_back(self, step: int, saved: dict[str, Any] | None) -> None:
        self._background.wait(self._last_task)
        self.cut(step, saved)

    # -- events ------------------------------------------------------------------------
    def on_train_start(self, ctx: CallbackContext) -> None:
        loaded, self._loaded = self._loaded, None
        cut, self._cut_before_start = self._cut_before_start, False
        st = ctx.state
        if not st.is_rank_zero:
            return
        if loaded is not None or (ctx.run.resuming and not cut):
            self._cut_back(st.step, loaded)  # asked to resume, no checkpoint: restarts here
        self.open(ctx)
        start = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "resumed": st.step > 0,
            "max_steps": st.max_steps,
        }
        self._hand_over("start", st, start, copy.copy(st))

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        loaded, self._loaded = self._loaded, None
        st = ctx.state
        self._cut_before_start = not st.in_training  # a resume, not a rewind
        if not st.is_rank_zero:
            return
        self._cut_back(st.step, loaded)
        if ctx.rewind is not None:
            self._hand_over("rewind", st, ctx.rewind.to_json())

    def on_log(self, ctx: CallbackContext) -> None:
        st = ctx.state
        if st.is_rank_zero:
            logs = ctx.logs or {}
            values = dict(logs) if plain_values(logs) else self.prepare(logs)
            record = Record("train", st.step, epoch_of(st), _now(), values)
            self._last_task = self._background.submit(self.write, record)

    def on_settings_change(self, ctx: CallbackContext) -> None:
        """A live ``set`` (:mod:`hookloop.loop.live`): one ``set`` record per key changed."""
        if ctx.state.is_rank_zero:
            for change in ctx.changes or ():
                values = {"key": change.key, "old": change.old, "new": change.new}
                self._hand_over("set", ctx.state, {**values, "client": change.client})

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._record_metrics("eval", ctx)

    def on_test_end(self, ctx: CallbackContext) -> None:
        self._record_metrics("test", ctx)

    def _record_metrics(self, kind: str, ctx: CallbackContext) -> None:
        if ctx.state.is_rank_zero:
            metrics = ctx.metrics or {}
            values = dict(metrics) if plain_values(metrics) else self.prepare(metrics)
            self._hand_over(kind, ctx.state, values)

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        if ctx.state.is_rank_zero:
            self.flush()  # a SIGKILL from now on leaves every record up to this checkpoint
            self._last_task = self._background.submit(self.sync, True)  # not waited for

    def on_train_end(self, ctx: CallbackContext) -> None:
        st = ctx.state
        if st.is_rank_zero:
            reason = st.stop_reason
            status = "failed" if st.failed else run_status(reason)
            self._hand_over("end", st, {"status": status, "stop_reason": reason}, copy.copy(st))
        self.close()

    def on_exception(self, ctx: CallbackContext) -> None:
        st = ctx.state
        if st.in_training and st.is_rank_zero:  # a start that failed has no start record
            exc = ctx.exception
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            error = f"{type(exc).__name__}: {exc}"[:500] if exc is not None else None
            end = {"status": status, "stop_reason": status, "error": error}
            self._hand_over("end", st, end, copy.copy(st))
        self.close()

    def _hand_over(
        self, kind: str, st: TrainState, values: dict[str, Any], state: TrainState | None = None
    ) -> None:
        record = Record(kind, st.step, epoch_of(st), _now(), values, state)
        self._last_task = self._background.submit(self.write, record)


def epoch_of(st: TrainState) -> float | int:
    """The epoch as a train log shows it: completed epochs plus the share of this one
    done (an evaluation or the end is then dated as the log beside it)."""
    if not st.steps_per_epoch or not st.epoch_step:
        return st.epoch
    return st.epoch + st.epoch_step / st.steps_per_epoch


_SCALARS = {int, float, str, bool, type(None)}


def plain_values(values: dict[str, Any]) -> bool:
    """Whether every value is a plain Python scalar: nothing to read from a device, so a
    logger may hand the values to its writer thread as they are."""
    return set(map(type, values.values())) <= _SCALARS


def _read(value: Any) -> Any:
    """A value that is no plain scalar, read now: a number (a tensor's, a NumPy scalar's) as
    a float, anything else as its string (subclasses of int and str stay as they are)."""
    if isinstance(value, (int, str)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
