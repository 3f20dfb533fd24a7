"""A progress log in Megatron-LM's format: ``progress.txt`` in the run directory.

Long runs are many jobs: each is killed or times out and the next resumes from
the newest checkpoint. The progress log is the one record that spans them, so
throughput can be judged over the whole run and not only the current job. One
line per event, tab-separated, every field but the message written as ``Key: value``::

    2026-11-23 14:02:11<TAB>Job ID: 8812<TAB># GPUs: 8<TAB>Starting job
    2026-11-23 14:09:40<TAB>Job ID: 8812<TAB># GPUs: 8<TAB>Saved checkpoint<TAB>Iteration: 500
        <TAB>Job throughput: 181.3 TFLOP/s/GPU<TAB>Cumulative throughput: 179.9 TFLOP/s/GPU
        <TAB>Floating-point operations: 5.71e+18<TAB>Tokens (in billions): 1.05
        <TAB>Save time: 2.41 s<TAB>Blocked: 2.41 s

(the save line is one line in the file). Every field up to ``Tokens`` sits
where Megatron-LM writes it (its own reader takes the FLOPs from the eighth);
``Save time`` and ``Blocked`` (the checkpoint's :class:`~hookloop.state.SaveTiming`)
come after them. A rewind
after a divergence (:mod:`hookloop.checkpoint.rewind`) adds a ``Rewound`` line: ``Iteration``
(where it was confirmed), ``To iteration``, ``Diverged from``, ``Batches skipped``. A live
``set`` (:mod:`hookloop.loop.live`) adds a ``Changed setting`` line per key: ``Iteration``,
``Key``, ``Old``, ``New``, ``Client``. Both sit after the three fields every line starts
with, so readers that look for the lines they know (Megatron-LM's) pass them by.

*Job throughput* counts the FLOPs and wall time of this job only. *Cumulative
throughput* counts from the start of the first job that ran with the same
number of ranks: :func:`first_job_start` reads its start time, and the FLOPs
already done when it began, back from the file (a change of world size starts
the count afresh, as throughput per device is not comparable across sizes).

The FLOPs are the loop's own estimate, ``state.flops`` (restored from the
checkpoint on resume): the recipe's ``flops_per_sample`` or the user's
``train.flops_per_sample``. Without an estimate the throughputs read 0.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from hookloop.callback import Callback
from hookloop.state import CallbackContext

#: The timestamp at the start of each line (local time, whole seconds).
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STARTING_JOB = "Starting job"
SAVED_CHECKPOINT = "Saved checkpoint"
#: What Megatron-LM writes for a save still being finished in the background.
SAVING_ASYNC = "Saving async checkpoint"
#: A divergence rolled back (hookloop.checkpoint.rewind); Megatron-LM's tools skip lines
#: they do not know.
REWOUND = "Rewound"
#: A live ``set`` (hookloop.loop.live), one line per key; Megatron-LM's tools skip it too.
CHANGED_SETTING = "Changed setting"


def job_id() -> str:
    """The scheduler's job id (``SLURM_JOB_ID``), else one made up for this process."""
    return os.environ.get("SLURM_JOB_ID") or f"local-{uuid.uuid4().hex[:8]}"


def format_figure(value: float, decimals: int) -> str:
    """A figure as Megatron-LM writes it (``decimals`` fixed), with more digits below 1.

    Fixed decimals turn the throughput of a small model into ``0.0``; below 1
    the figure keeps four significant digits instead, and still parses as a float.
    """
    return f"{value:.{decimals}f}" if abs(value) >= 1 or value == 0 else f"{value:.4g}"


def tflops_per_device(flops: float, seconds: float, world_size: int) -> float:
    """FLOPs over ``seconds`` as TFLOP/s per rank (0 when no time has passed)."""
    if seconds <= 0:
        return 0.0
    return flops / seconds / 1e12 / world_size


@dataclass(frozen=True)
class JobStart:
    """When the first job of a world size started, and the FLOPs done before it."""

    time: datetime
    flops: float


def _field(token: str) -> str:
    return token.split(": ", 1)[1]


def first_job_start(path: str | Path, world_size: int) -> JobStart | None:
    """The start of the earliest job in an unbroken series run with ``world_size`` ranks.

    Walks the log in order: a save line records the FLOPs done so far; a line
    written with another world size forgets the start found so far; the first
    ``Starting job`` after that is the answer, with the FLOPs of the last save
    before it. None when there is no such line (or no file).
    """
    start: JobStart | None = None
    latest_flops = 0.0
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        tokens = line.strip().split("\t")
        if len(tokens) < 4:
            continue  # a line cut short by a kill
        try:
            ranks = int(_field(tokens[2]))
            if tokens[3] in (SAVED_CHECKPOINT, SAVING_ASYNC) and len(tokens) > 7:
                latest_flops = float(_field(tokens[7]))
            if ranks != world_size:
                start = None
                continue
            if tokens[3] == STARTING_JOB and start is None:
                start = JobStart(datetime.strptime(tokens[0], TIME_FORMAT), latest_flops)
        except (IndexError, ValueError):
            continue  # not one of our lines, or torn: the rest of the log still counts
    return start


class ProgressLog(Callback):
    """Appends a ``Starting job`` line when training starts and a line per checkpoint save.

    ``path`` defaults to the run directory's ``progress.txt``; a run without a
    run directory writes nothing. Only global rank 0 writes. ``job`` names the
    job (default: :func:`job_id`).
    """

    priority = 100

    def __init__(self, path: str | Path | None = None, *, job: str | None = None) -> None:
        if path is not None and not isinstance(path, (str, Path)):
            raise TypeError(f"path must be a str, a Path or None, got {type(path).__name__}")
        if job is not None and (not isinstance(job, str) or not job or "\t" in job):
            raise ValueError(f"job must be a non-empty str without tabs, or None, got {job!r}")
        self.path = None if path is None else Path(path)
        self.job = job
        self._target: Path | None = None
        self._started = 0.0  # time.time() when this job began training
        self._start_flops = 0.0  # state.flops then (restored by a resume)

    def on_train_start(self, ctx: CallbackContext) -> None:
        st = ctx.state
        self._target = self.path or (ctx.run.dir.progress_log if ctx.run.dir else None)
        if self._target is None or not st.is_rank_zero:
            self._target = None
            return
        if self.job is None:
            self.job = job_id()
        self._started, self._start_flops = self.job_started(ctx), st.flops
        self._append(STARTING_JOB, st.world_size)

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        if self._target is None:
            return
        st = ctx.state
        flops, world = st.flops, st.world_size
        now = time.time()
        job = tflops_per_device(flops - self._start_flops, now - self._started, world)
        first = first_job_start(self._target, world)
        if first is None:  # our own start line is gone (the file was removed): count this job
            first = JobStart(datetime.fromtimestamp(self._started), self._start_flops)
        cumulative = tflops_per_device(
            flops - first.flops, (datetime.fromtimestamp(now) - first.time).total_seconds(), world
        )
        for message in self.save_lines(ctx, job, cumulative):
            self._append(message, world)

    def save_lines(self, ctx: CallbackContext, job: float, cumulative: float) -> list[str]:
        """The line(s) one save appends, given its job and cumulative TFLOP/s per device."""
        st = ctx.state
        fields = [
            SAVED_CHECKPOINT,
            f"Iteration: {st.step}",
            f"Job throughput: {format_figure(job, 1)} TFLOP/s/GPU",
            f"Cumulative throughput: {format_figure(cumulative, 1)} TFLOP/s/GPU",
            f"Floating-point operations: {st.flops:.2e}",
            f"Tokens (in billions): {format_figure(st.tokens / 1e9, 2)}",
        ]
        timing = ctx.checkpoint_timing
        if timing is not None:
            fields += [
                f"Save time: {timing.seconds:.3f} s",
                f"Blocked: {timing.blocked_seconds:.3f} s",
            ]
        return ["\t".join(fields)]

    def job_started(self, ctx: CallbackContext) -> float:
        """When this job started (``time.time()``): here, when training starts."""
        return time.time()

    def on_settings_change(self, ctx: CallbackContext) -> None:
        if self._target is None:
            return
        for change in ctx.changes or ():
            fields = [
                CHANGED_SETTING,
                f"Iteration: {change.step}",
                f"Key: {change.key}",
                f"Old: {json.dumps(change.old)}",
                f"New: {json.dumps(change.new)}",
                f"Client: {' '.join(change.client.split())}",
            ]
            self._append("\t".join(fields), ctx.state.world_size)

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        rewind = ctx.rewind
        if self._target is None or rewind is None:
            return
        fields = [
            REWOUND,
            f"Iteration: {rewind.from_step}",
            f"To iteration: {rewind.to_step}",
            f"Diverged from: {rewind.since_step}",
            f"Batches skipped: {rewind.batches_skipped}",
        ]
        self._append("\t".join(fields), ctx.state.world_size)

    def _append(self, message: str, world_size: int) -> None:
        assert self._target is not None
        stamp = datetime.now().strftime(TIME_FORMAT)
        if message == STARTING_JOB:  # stamped when the job started, which may be earlier
            stamp = datetime.fromtimestamp(self._started).strftime(TIME_FORMAT)
        line = f"{stamp}\tJob ID: {self.job}\t# GPUs: {world_size}\t{message}\n"
        self._target.parent.mkdir(parents=True, exist_ok=True)
        with open(self._target, "a") as f:  # one write per line: a kill loses at most that line
            f.write(line)
