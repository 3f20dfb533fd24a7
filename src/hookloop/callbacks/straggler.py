"""Straggler detection: name the ranks that hold the others back.

Under DDP every rank waits for the slowest in the gradient all-reduce, so the
wall time of a step is the same on every rank and says nothing about who is
slow. What differs is the time each rank spends on its *own* work before it
joins the collective. :class:`StragglerDetection` measures, per step:

- **data wait**: from the end of the previous step to the start of this one
  (fetching the micro-batches, and whatever later callbacks did at the step
  end), less the evaluation time and the time checkpoint saves blocked the
  loop in between;
- **compute**: from the start of the step to the end of the model's forward
  pass on its last micro-batch (callbacks at the step start, the forward, and
  under accumulation the earlier micro-batches, which do not synchronise).

Their sum is the rank's own time. The first step after the start (or a
resume) is left out: it carries the set-up of every callback and the first
batch's loader start, which say nothing about a rank's speed. Every ``every``
steps each rank's means over the window are gathered (one ``all_gather`` of
three numbers), and a rank whose own time exceeds ``threshold`` times the
median over all ranks is a straggler.
Rank 0 logs each straggler with its rank and host (logger
``hookloop.straggler``, a warning), and every rank keeps the latest report in
``ctx.user_state["stragglers"]``, which the control server's status shows.

Under ``train.parallel='fsdp'`` the forward itself gathers parameters from
every rank, so only the data wait tells ranks apart there.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.distributed import all_gather_tensor, gather_objects
from hookloop.state import CallbackContext

log = logging.getLogger("hookloop.straggler")

#: The ``ctx.user_state`` key the latest report is published under.
REPORT_KEY = "stragglers"


class StragglerDetection(Callback):
    """Every ``every`` steps, report ranks slower than ``threshold`` x the median.

    ``every``: steps per measurement window (an int >= 1); ``threshold``: how
    many times the median own time per step a rank may take before it is
    named (a number > 1). The report (``ctx.user_state["stragglers"]``) is a
    dict: ``step``, ``median_s``, ``threshold``, ``ranks`` (every rank's
    ``rank``, ``host``, ``step_s``, ``data_wait_s``, ``compute_s``) and
    ``stragglers`` (the slow ones, each with its ``ratio`` to the median).
    """

    priority = 2  # time the step before other callbacks add their own work to it

    def __init__(self, every: int = 100, threshold: float = 1.4) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (steps per window), got {every!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(f"threshold must be a number > 1, got {threshold!r}")
        if not threshold > 1:
            raise ValueError(
                f"threshold must be > 1 (times the median step time), got {threshold!r}"
            )
        self.every = every
        self.threshold = float(threshold)
        self.hosts: list[str] = []
        self.report: dict[str, Any] | None = None
        self._hook: Any = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._sums = [0.0, 0.0]  # data wait, compute
        self._steps = 0
        self._last_end: float | None = None  # end of the previous step
        self._excluded = 0.0  # evaluation and checkpoint time since then
        self._eval_started: float | None = None
        self._step_started = 0.0
        self._wait: float | None = None  # this step's data wait; None: not timed
        self._forward_end: float | None = None

    # -- events ---------------------------------------------------------------
    def on_train_start(self, ctx: CallbackContext) -> None:
        self.hosts = [str(h) for h in gather_objects(socket.gethostname())]
        self._remove_hook()
        self._hook = ctx.model.register_forward_hook(self._forward_done)
        self._reset_window()

    def on_train_step_start(self, ctx: CallbackContext) -> None:
        now = time.perf_counter()
        self._wait = None if self._last_end is None else now - self._last_end - self._excluded
        self._excluded = 0.0
        self._forward_end = None
        self._step_started = now

    def _forward_done(self, module: Any, inputs: Any, output: Any) -> None:
        if module.training:  # not the evaluation's forwards
            self._forward_end = time.perf_counter()

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        now = time.perf_counter()
        forward_end = self._forward_end if self._forward_end is not None else now
        if self._wait is not None:  # not the first step after the start
            self._sums[0] += max(0.0, self._wait)
            self._sums[1] += forward_end - self._step_started
            self._steps += 1
        if ctx.state.step % self.every == 0:
            self._gather(ctx)
        self._last_end = time.perf_counter()

    def on_eval_start(self, ctx: CallbackContext) -> None:
        self._eval_started = time.perf_counter()

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if self._eval_started is not None:
            self._excluded += time.perf_counter() - self._eval_started
            self._eval_started = None

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        timing = ctx.checkpoint_timing
        if timing is not None:
            self._excluded += timing.blocked_seconds  # what the loop waited for

    def on_train_end(self, ctx: CallbackContext) -> None:
        self._remove_hook()

    def on_exception(self, ctx: CallbackContext) -> None:
        self._remove_hook()

    # -- the report -------------------------------------------------------------
    def _gather(self, ctx: CallbackContext) -> None:
        steps = max(self._steps, 1)
        wait, compute = (s / steps for s in self._sums)
        mine = torch.tensor([wait + compute, wait, compute], dtype=torch.float64)
        device = ctx.run.device
        table = all_gather_tensor(mine.to(device) if device is not None else mine).cpu().tolist()
        self._sums, self._steps = [0.0, 0.0], 0
        self.report = build_report(ctx.state.step, table, self.hosts, self.threshold)
        ctx.user_state[REPORT_KEY] = self.report
        if ctx.state.is_rank_zero:
            for slow in self.report["stragglers"]:
                log.warning(
                    "hookloop: straggler at step %d: rank %d on host %s takes %.4f s/step, "
                    "%.2fx the median %.4f s (data wait %.4f s, compute %.4f s)",
                    self.report["step"],
                    slow["rank"],
                    slow["host"],
                    slow["step_s"],
                    slow["ratio"],
                    self.report["median_s"],
                    slow["data_wait_s"],
                    slow["compute_s"],
                )

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def build_report(
    step: int, table: list[list[float]], hosts: list[str], threshold: float
) -> dict[str, Any]:
    """The report for one window: ``table`` holds each rank's (own, data wait, compute) means.

    >>> r = build_report(8, [[0.01, 0.0, 0.01], [0.05, 0.0, 0.05], [0.011, 0.001, 0.01]],
    ...                  ["a", "b", "c"], 1.4)
    >>> [(s["rank"], s["host"], s["ratio"]) for s in r["stragglers"]]
    [(1, 'b', 4.545)]
    """
    median = statistics.median(row[0] for row in table)
    ranks = [
        {
            "rank": rank,
            "host": hosts[rank] if rank < len(hosts) else "?",
            "step_s": round(own, 6),
            "data_wait_s": round(wait, 6),
            "compute_s": round(compute, 6),
        }
        for rank, (own, wait, compute) in enumerate(table)
    ]
    stragglers = [
        {**entry, "ratio": round(row[0] / median, 3)}
        for entry, row in zip(ranks, table, strict=True)
        if median > 0 and row[0] > threshold * median
    ]
    return {
        "step": step,
        "median_s": round(median, 6),
        "threshold": threshold,
        "ranks": ranks,
        "stragglers": stragglers,
    }
