"""What a training run ends with, and the process exit code that reports it.

The loop records *why* it stopped (``stop_reason``, a caught ``signal``);
turning that into a process exit code is the command line's business, so the
codes live here, beside the result, rather than in the loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ExitCode(enum.IntEnum):
    """Process exit codes of ``hookloop train`` (``TrainResult.exit_code``)."""

    OK = 0  # finished, or stopped on request / exit_interval / exit_duration (after saving)
    ERROR = 1  # an exception
    USAGE = 2  # bad command line or config
    ABORTED = 3  # ended by an abort request; nothing saved
    FAILED = 4  # the run failed: NaN, divergence, too many skipped steps (whatever it saved)
    SIGINT = 130  # 128 + SIGINT: interrupted, checkpoint saved
    SIGTERM = 143  # 128 + SIGTERM: terminated (e.g. preempted), checkpoint saved


def run_status(stop_reason: str | None) -> str:
    """``finished`` (the step or epoch budget was reached), ``aborted``, or ``stopped``.

    ``stopped`` covers every other orderly end: a stop request, a signal,
    ``exit_interval`` or ``exit_duration`` (these save a checkpoint and can be resumed).
    """
    reason = stop_reason or ""
    if reason in ("max_steps", "max_epochs", "finished", ""):
        return "finished"
    if reason.startswith("abort"):
        return "aborted"
    return "stopped"


def reason_without_step(stop_reason: str, step: int) -> str:
    """``stop_reason`` for a line that already says "at step N": a reason that names the
    same step (``NaNDetection: non-finite loss (nan) at step 3 (...)``) says it once.

    >>> reason_without_step("NaNDetection: non-finite loss (nan) at step 3 (skipped)", 3)
    'NaNDetection: non-finite loss (nan) (skipped)'
    """
    return stop_reason.replace(f" at step {step}", "", 1)


def is_abort(stop_reason: str | None) -> bool:
    """Whether ``stop_reason`` records an abort (which saves nothing)."""
    return stop_reason is not None and stop_reason.startswith("abort")


@dataclass
class TrainResult:
    """What ``Trainer.train()`` returns."""

    step: int
    epoch: int
    stop_reason: str
    #: The SIGTERM / SIGINT that ended the run, if one did.
    signal: int | None = None
    #: The run failed (a detector's stop or abort, or too many skipped steps).
    failed: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    logs: dict[str, float] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """0 on a finish or a requested stop, 4 on a failure, 3 on an abort, 128 + N after
        signal N."""
        if self.failed:
            return ExitCode.FAILED
        if is_abort(self.stop_reason):
            return ExitCode.ABORTED
        if self.signal is not None:
            return 128 + self.signal
        return ExitCode.OK
