"""torch.profiler over a window of training steps: a Chrome trace and summary tables.

The profiler starts with training and advances one schedule step per optimizer
step: ``skip_first`` and ``wait`` steps are ignored, ``warmup`` steps are traced
but discarded (the first traced steps carry start-up costs), ``active`` steps
are recorded, and the cycle runs ``repeat`` times. At the end of each cycle the
output directory (default ``<out_dir>/profile``, or ``./profile`` without an
``out_dir``) receives:

- ``trace_step<N>_rank<R>.json``: open it in ``chrome://tracing`` or Perfetto;
- ``summary_step<N>_rank<R>.txt``: operator tables sorted by self CPU time
  and, on CUDA, by self device time.

``N`` is the optimizer step that closed the window. Each step is marked in the trace
as ``hookloop step <n>``, numbered as the run counts (torch's own ``ProfilerStep#k``
counts from 0 where profiling began). Once every cycle is recorded the profiler is
stopped, so the rest of training runs unprofiled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.rundir import PROFILE_DIR
from hookloop.state import CallbackContext

log = logging.getLogger("hookloop.profiler")


class ProfilerCallback(Callback):
    """Profiles a window of training steps (see the module doc).

    ``ranks`` lists the ranks that profile (default rank 0 only; ``None``: all).
    ``record_shapes``, ``with_stack``, ``with_flops`` and ``profile_memory`` are
    passed to ``torch.profiler.profile``; ``row_limit`` caps each table.

    Forgather's window, ``start_step`` and ``num_steps`` (record the ``num_steps``
    steps after ``start_step`` steps have run), is accepted instead of
    ``wait``/``warmup``/``active``: it records the same steps, after one warmup
    step when there is room for it.
    """

    priority = 15

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        *,
        skip_first: int = 0,
        output_dir: str | Path | None = None,
        ranks: Sequence[int] | None = (0,),
        record_shapes: bool = True,
        with_stack: bool = False,
        with_flops: bool = True,
        profile_memory: bool = False,
        row_limit: int = 30,
        start_step: int | None = None,
        num_steps: int | None = None,
    ) -> None:
        if start_step is not None or num_steps is not None:
            start = 0 if start_step is None else start_step
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
            warmup = min(start, 1)
            wait, active = start - warmup, 5 if num_steps is None else num_steps
        for name, value, low in (
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active" if num_steps is None else "num_steps", active, 1),
            ("repeat", repeat, 1),
            ("skip_first", skip_first, 0),
            ("row_limit", row_limit, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        _check_flags_and_places(
            record_shapes, with_stack, with_flops, profile_memory, output_dir, ranks
        )
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.skip_first = skip_first
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.ranks = tuple(ranks) if ranks is not None else None
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.with_flops = with_flops
        self.profile_memory = profile_memory
        self.row_limit = row_limit
        self.files: list[Path] = []  # everything written, in order
        self._prof: Any = None
        self._cycles = 0
        self._dir = Path(PROFILE_DIR)
        self._rank = 0
        self._cuda = False
        self._step = 0
        self._mark: Any = None  # the open ``hookloop step <n>`` range of the trace

    def on_train_start(self, ctx: CallbackContext) -> None:
        self._rank = ctx.state.rank
        if self.ranks is not None and self._rank not in self.ranks:
            return
        run_dir = ctx.run.dir
        self._dir = self.output_dir or (
            run_dir.profile if run_dir is not None else Path(PROFILE_DIR)
        )
        self._dir.mkdir(parents=True, exist_ok=True)
        device = ctx.run.device
        self._cuda = device is not None and torch.device(device).type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._cycles = 0
        self._step = ctx.state.step
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait,
                warmup=self.warmup,
                active=self.active,
                repeat=self.repeat,
                skip_first=self.skip_first,
            ),
            on_trace_ready=self._export,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            profile_memory=self.profile_memory,
        )
        self._prof.start()

    def on_train_step_start(self, ctx: CallbackContext) -> None:
        if self._prof is not None:
            self._mark = torch.profiler.record_function(f"hookloop step {ctx.state.step}")
            self._mark.__enter__()

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        self._close_mark()
        if self._prof is None:
            return
        self._step = ctx.state.step
        self._prof.step()
        if self._cycles >= self.repeat:
            self._stop()

    def on_train_end(self, ctx: CallbackContext) -> None:
        self._stop()  # a window cut short by the end of training is still written

    def on_exception(self, ctx: CallbackContext) -> None:
        self._stop()

    def _close_mark(self) -> None:
        mark, self._mark = self._mark, None
        if mark is not None:
            mark.__exit__(None, None, None)

    def _stop(self) -> None:
        self._close_mark()
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()

    def _export(self, prof: Any) -> None:
        """Write one finished window (torch calls this)."""
        self._cycles += 1
        self.files += self.write_window(prof, self._dir, self._step, self._rank, self._cuda)

    def write_window(
        self, prof: Any, directory: Path, step: int, rank: int, cuda: bool
    ) -> list[Path]:
        """Write the trace and the tables of the window that ended at ``step``; returns the
        files written. A subclass may write other files (Forgather's names, say)."""
        stem = f"step{step}_rank{rank}"
        trace = directory / f"trace_{stem}.json"
        prof.export_chrome_trace(str(trace))
        averages = prof.key_averages()
        sections = [("self CPU time", "self_cpu_time_total")]
        if cuda:
            sections.append(("self device time", "self_device_time_total"))
        text = "".join(
            f"== sorted by {title} ==\n"
            + averages.table(sort_by=key, row_limit=self.row_limit)
            + "\n\n"
            for title, key in sections
        )
        summary = directory / f"summary_{stem}.txt"
        summary.write_text(text, encoding="utf-8")
        log.info("profiler: wrote %s and %s", trace, summary)
        return [trace, summary]

    def __repr__(self) -> str:
        return (
            f"ProfilerCallback(priority={self.priority}, wait={self.wait}, "
            f"warmup={self.warmup}, active={self.active}, repeat={self.repeat})"
        )


def _check_flags_and_places(
    record_shapes: Any,
    with_stack: Any,
    with_flops: Any,
    profile_memory: Any,
    output_dir: Any,
    ranks: Any,
) -> None:
    """The constructor's flags are bools, its directory a path, its ranks ints >= 0."""
    for name, flag in (
        ("record_shapes", record_shapes),
        ("with_stack", with_stack),
        ("with_flops", with_flops),
        ("profile_memory", profile_memory),
    ):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if output_dir is not None and (not isinstance(output_dir, (str, Path)) or not str(output_dir)):
        raise ValueError(f"output_dir must be a directory path or None, got {output_dir!r}")
    if ranks is not None and (
        isinstance(ranks, (str, bytes))
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        raise ValueError(f"ranks must be a list of ranks (ints >= 0) or None (all), got {ranks!r}")
