"""TensorBoard logging that rewinds on resume.

Two pieces, as in Forgather:

- :class:`ResumableSummaryWriter` wraps TensorBoard's writer as used through
  ``torch.utils.tensorboard.SummaryWriter``. It opens the writer lazily and is
  stateful: when a run resumes from a checkpoint at step ``S``, the next writer
  is opened with ``purge_step=S + 1``. That writes a ``SessionLog.START`` event,
  and TensorBoard's readers then hide every event of the earlier session whose
  step is above ``S``, so the steps the resumed run repeats appear once. A resume
  that finds no checkpoint restarts from step 0 and purges everything after it.
  Other callbacks may share one writer (``add_scalar``, ``add_text``, ... are
  passed through).
- :class:`TBLogger` writes every numeric value of each log event
  (``train/<key>``) and evaluation (``eval/<key>``, ``test/<key>``) as a scalar
  at the current step, the resolved config (YAML, as text) when training
  starts, and a run summary (text) when it ends.

Why ``torch.utils.tensorboard.SummaryWriter`` rather than
``tensorboard.summary.Writer``: it is TensorBoard's own event-file writer
(``tensorboard.summary.writer.EventFileWriter``) behind a small API, and it has
the two things this module needs that TensorBoard's (experimental) writer lacks:
``purge_step`` and text summaries; its scalars are the ones TensorBoard's scalar
readers show. Only rank 0 writes.

Scalars and text are handed to the shared background writer
(:mod:`hookloop.callbacks._writer`), which makes the ``SummaryWriter`` calls; the loop
pays for a queue entry. The other ``add_*`` methods (histograms, images, ...) run at
once, since their tensors may change by the next step. The queue is drained and the
event file flushed before a checkpoint's state is taken, and again in the background at
``on_checkpoint_save``.

Only public names of torch's and TensorBoard's are used, and nothing of TensorBoard's is
changed for the rest of the process (another ``SummaryWriter``, transformers' included,
writes as it would without hookloop). A log's scalars go into the event file as one
event (torch's ``summary.scalar`` for each value, written through the writer's
``file_writer``, a ``FileWriter``, as torch's own ``add_hparams`` writes), not one event
per value as ``add_scalar`` makes them: without TensorFlow, TensorBoard checksums each
event in pure Python on its own thread, ~20 µs of CPU an event on the 2-core machine,
so a log of ten values costs about a third (``bench/results/2026-12-06-loop.md``).
TensorBoard's readers see the same tags, steps, values and wall times.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hookloop._optional import require
from hookloop.callback import Callback
from hookloop.callbacks._writer import log_writer
from hookloop.callbacks.jsonlog import metric_tag, numeric_metrics
from hookloop.callbacks.logger import Logger, Record, run_status
from hookloop.config import dump_yaml
from hookloop.state import CallbackContext

_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.")


def _summary_writer_type() -> Any:
    """torch's ``SummaryWriter``, or an error naming the extra to install."""
    require("tensorboard", extra="tensorboard", feature="TensorBoard logging")
    require("torch.utils.tensorboard", extra="tensorboard", feature="TensorBoard logging")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def _scalars_summary(values: dict[str, Any]) -> Any:
    """One ``Summary`` of the scalar values ``SummaryWriter.add_scalar`` would write one by
    one (torch's public ``summary.scalar``, TensorBoard's ``Summary`` proto)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard.summary import scalar

    return Summary(value=[v for tag, x in values.items() for v in scalar(tag, float(x)).value])


class ResumableSummaryWriter(Callback):
    """A lazily opened TensorBoard ``SummaryWriter`` that purges stale events on resume.

    Register it as a callback (or give it to :class:`TBLogger`, which then
    drives it) so that it sees the resume. Its priority (105) puts its
    ``on_train_end`` after the loggers that write through it.
    """

    priority = 105

    def __init__(self, log_dir: str | Path, *, flush_secs: float = 10.0, max_queue: int = 100):
        if not isinstance(log_dir, (str, Path)) or not str(log_dir):
            raise ValueError(f"log_dir must be a directory path, got {log_dir!r}")
        if not flush_secs > 0:
            raise ValueError(f"flush_secs must be > 0, got {flush_secs!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        _summary_writer_type()  # fail now, naming the extra, rather than mid-run
        self.log_dir = Path(log_dir)
        self.flush_secs = flush_secs
        self.max_queue = max_queue
        self.enabled = True  # False on ranks other than 0: every call is then a no-op
        self._writer: Any = None
        self._open_lock = threading.Lock()  # the loop and the writer thread may both open it
        self._background = log_writer()
        self._purge_step: int | None = None
        self._rewound = False

    # -- resume --------------------------------------------------------------
    def rewind(self, step: int) -> None:
        """Hide events after ``step``: the next writer opens with ``purge_step=step + 1``."""
        self.close()
        self._purge_step = int(step) + 1
        self._rewound = True

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        self.enabled = ctx.state.is_rank_zero
        self.rewind(ctx.state.step)

    def on_train_start(self, ctx: CallbackContext) -> None:
        self.enabled = ctx.state.is_rank_zero
        rewound, self._rewound = self._rewound, False
        if not rewound and ctx.run.resuming:
            # Asked to resume but no checkpoint was loaded: training restarts at this step.
            self.close()
            self._purge_step = ctx.state.step + 1

    def on_train_end(self, ctx: CallbackContext) -> None:
        self.close()

    def on_exception(self, ctx: CallbackContext) -> None:
        self.close()

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        if self.enabled:
            self._background.submit(self._flush_now)

    def state_dict(self) -> dict[str, Any]:
        self.flush()  # everything up to the checkpoint is on disk when it is committed
        return {"log_dir": str(self.log_dir)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the purge step comes from the restored train step."""

    # -- the writer ------------------------------------------------------------
    @property
    def writer(self) -> Any:
        """The underlying ``SummaryWriter``, opened on first use."""
        if self._writer is None:
            with self._open_lock:
                if self._writer is None:
                    self._writer = self._open()
        return self._writer

    def _open(self) -> Any:
        cls = _summary_writer_type()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        _wait_for_a_later_second(self.log_dir)
        writer = cls(
            str(self.log_dir),
            purge_step=self._purge_step,
            flush_secs=self.flush_secs,
            max_queue=self.max_queue,
        )
        self._purge_step = None  # purge once, when the writer after a resume opens
        return writer

    def add_scalar(self, tag: str, value: float, step: int, **kwargs: Any) -> None:
        if self.enabled:
            self.writer.add_scalar(tag, value, global_step=step, **kwargs)

    def add_scalars_at(self, values: dict[str, Any], step: int, kind: str | None = None) -> None:
        """Several scalars at one step, handed to the writer thread as ONE queue entry.

        The loop pays for the hand-over only; the writer thread makes one ``add_scalar``
        per value, all stamped with the same wall time. With ``kind`` (``"train"``,
        ``"eval"``, ``"test"``), ``values`` are a log's or metrics' own keys and values,
        numbers or not: the numbers among them are written, tagged as
        :func:`~hookloop.callbacks.jsonlog.metric_tag` says, and that choice is made on the
        writer thread (so the values must need no device read).
        """
        if not self.enabled or not values:
            return
        self._background.submit(self._write_scalars, values, step, kind)

    def _write_scalars(self, values: dict[str, Any], step: int, kind: str | None = None) -> None:
        """On the writer thread: ``values`` as scalars at ``step``."""
        if kind is not None:
            values = {metric_tag(kind, k): v for k, v in numeric_metrics(values).items()}
        if not values:
            return
        writer, now = self.writer, time.time()
        file_writer = writer.file_writer  # None once closed: add_scalar opens it again
        if file_writer is None or len(values) == 1:
            for tag, value in values.items():
                writer.add_scalar(tag, float(value), global_step=step, walltime=now)
            return
        # One event of all the values (what add_scalar makes, one per value): TensorBoard
        # checksums each event in pure Python, so one instead of N costs ~1/3 of the CPU.
        file_writer.add_summary(_scalars_summary(values), step, now)

    def add_text(self, tag: str, text: str, step: int, **kwargs: Any) -> None:
        if self.enabled:
            self._background.submit(self._add_text, tag, text, step, kwargs)

    def _add_text(self, tag: str, text: str, step: int, kwargs: dict[str, Any]) -> None:
        self.writer.add_text(tag, text, global_step=step, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Any other ``SummaryWriter`` method (``add_histogram``, ``add_figure``, ...)."""
        if name.startswith("add_"):
            if not self.__dict__.get("enabled", True):
                return lambda *args, **kwargs: None
            return getattr(self.writer, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def flush(self) -> None:
        """Wait until everything handed over so far is in the event file."""
        self._background.flush()
        self._flush_now()

    def flush_later(self) -> None:
        """Flush the event file on the writer thread, without waiting for it."""
        self._background.submit(self._flush_now)

    def _flush_now(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self._background.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"ResumableSummaryWriter({str(self.log_dir)!r})"


def _wait_for_a_later_second(log_dir: Path) -> None:
    """Make the new event file sort after the existing ones.

    TensorBoard reads a directory's event files in name order, and the name
    starts with the creation time in whole seconds; a writer reopened within
    the same second (a fast resume) could otherwise be read before the file
    whose events it purges.
    """
    stamps = [int(m.group(1)) for p in log_dir.iterdir() if (m := _EVENT_FILE.match(p.name))]
    if stamps:
        wait = max(stamps) + 1 - time.time()
        if 0 < wait <= 1.0:  # a file stamped further ahead comes from a skewed clock: no wait
            time.sleep(wait)


class TBLogger(Logger):
    """Scalars, the config and a run summary in TensorBoard.

    ``TBLogger("runs/x/tb")`` owns a :class:`ResumableSummaryWriter` and drives
    its resume itself; ``TBLogger(writer)`` writes through a writer that is
    registered as a callback of its own (so that other callbacks can share it).
    The events, the resume and the flushes are those of every logger
    (:class:`~hookloop.callbacks.logger.Logger`); this is the TensorBoard backend:
    a cut reopens the owned writer with ``purge_step`` just after the step.
    """

    def __init__(
        self,
        log_dir: str | Path | ResumableSummaryWriter,
        *,
        log_config: bool = True,
        flush_secs: float = 10.0,
    ) -> None:
        if isinstance(log_dir, ResumableSummaryWriter):
            writer, owns_writer = log_dir, False
        elif isinstance(log_dir, (str, Path)) and str(log_dir):
            writer, owns_writer = ResumableSummaryWriter(log_dir, flush_secs=flush_secs), True
        else:
            raise ValueError(
                f"log_dir must be a directory path or a ResumableSummaryWriter, got {log_dir!r}"
            )
        super().__init__()
        self.writer, self._owns_writer = writer, owns_writer
        self.log_config = log_config
        self._started = 0.0
        self._last_logs: dict[str, Any] = {}

    # -- the backend ------------------------------------------------------------------
    def prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        return numeric_metrics(values)  # a tensor is read now; strings and the like left out

    def open(self, ctx: CallbackContext) -> None:
        self._started = time.monotonic()
        step = ctx.state.step
        self.writer.add_text("run/start", _markdown_table(self._start_info(ctx)), step)
        config = getattr(ctx.config, "to_dict", None)
        if self.log_config and config is not None:
            text = dump_yaml(config())
            self.writer.add_text("config", _code_block(text), step)

    def write(self, record: Record) -> None:
        """On the writer thread: a log's or an evaluation's numbers as one event of scalars
        (tagged as :func:`~hookloop.callbacks.jsonlog.metric_tag` says); the summary at the end."""
        kind, values = record.kind, record.values
        if kind == "train":
            if values:
                self._last_logs = values
                self.writer._write_scalars(values, record.step, kind)
        elif kind in ("eval", "test"):
            self.writer._write_scalars(values, record.step, kind)
            self.writer._flush_now()  # evaluations are rare: show them soon
        elif kind == "set":  # a live change: a text entry at its step
            text = f"`{values['key']}`: {values['old']!r} -> {values['new']!r} ({values['client']})"
            self.writer._add_text("settings/changes", text, record.step, {})
        elif kind == "start":
            self._last_logs = {}
        elif kind == "end":
            self.writer._add_text("run/summary", self._summary(record), record.step, {})

    def cut(self, step: int, saved: dict[str, Any] | None) -> None:
        if self._owns_writer:  # a shared writer, registered on its own, purges by itself
            self.writer.rewind(step)

    def position(self) -> dict[str, Any]:
        return {"log_dir": str(self.writer.log_dir)} if self._owns_writer else {}

    def sync(self, durable: bool) -> None:
        self.writer._flush_now()

    def release(self) -> None:
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()

    # -- the texts ----------------------------------------------------------------------
    def _summary(self, record: Record) -> str:
        values, st = record.values, record.state
        if "error" in values:  # ended by an exception
            status, reason = "failed", values["error"]
            reason = reason[:300] if isinstance(reason, str) else reason
        else:
            reason = values.get("stop_reason")
            status = run_status(reason)
        max_steps = st.max_steps if st is not None else None
        rows: dict[str, Any] = {
            "status": status,
            "stop reason": reason,
            "step": record.step if not max_steps else f"{record.step} / {max_steps}",
            "epoch": record.epoch,
            "wall time (this job)": _duration(time.monotonic() - self._started),
        }
        last = numeric_metrics(self._last_logs)
        rows.update({f"last {k}": _fmt(v) for k, v in last.items()})
        last_eval = st.last_eval if st is not None else {}
        rows.update({k: _fmt(v) for k, v in numeric_metrics(last_eval).items()})
        return _markdown_table(rows)

    def _start_info(self, ctx: CallbackContext) -> dict[str, Any]:
        st = ctx.state
        info: dict[str, Any] = {
            "run directory": ctx.run.dir.root if ctx.run.dir is not None else None,
            "recipe": getattr(ctx.config, "recipe", None),
            "resumed from step": st.step if st.step and ctx.run.resumed_from else None,
            "max steps": st.max_steps,
            "steps per epoch": st.steps_per_epoch,
            "world size": st.world_size,
            "host / pid": f"{socket.gethostname()} / {os.getpid()}",
        }
        return {k: v for k, v in info.items() if v is not None}


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _code_block(text: str) -> str:
    # TensorBoard renders text summaries as Markdown; indenting by four spaces keeps
    # YAML's own characters (``#``, ``*``, ``|``) literal.
    return "\n".join("    " + line for line in text.rstrip("\n").splitlines())


def _markdown_table(rows: dict[str, Any]) -> str:
    lines = ["| field | value |", "|---|---|"]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows.items()]
    return "\n".join(lines)
