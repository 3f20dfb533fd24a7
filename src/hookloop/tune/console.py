"""What a study prints: one line per trial, whatever the number of workers.

A trial's own output (run info, progress, evaluations) goes to its run directory
(``trial-NNNN/console.log``) and to its worker's log (``workers/worker-N.log``); the
terminal gets one :func:`trial_line` as each trial ends. ``hookloop tune --verbose``
shows the trials' output and Optuna's ``[I ...]`` log lines on the terminal too.

Optuna logs each study it opens and each trial it finishes at INFO. hookloop's own
commands set Optuna's verbosity (:func:`optuna_verbosity`) for as long as they run, and
pass it to their worker processes (:data:`VERBOSITY_ENV`); ``hookloop.tune.run`` leaves
it as the caller set it (``optuna.logging.set_verbosity``).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from hookloop.tune.spec import CONSTRAINT_ATTR, optuna

#: Optuna's verbosity (a ``logging`` level number) in the study's worker processes.
VERBOSITY_ENV = "HOOKLOOP_TUNE_OPTUNA_VERBOSITY"
WORKER_LOGS = "workers"


def worker_log(study_dir: Path, index: int) -> Path:
    """Where worker ``index`` writes everything it prints (its trials' output too)."""
    return Path(study_dir) / WORKER_LOGS / f"worker-{index}.log"


def trial_line(trial: Any) -> str | None:
    """One line for a finished trial: its number, how it ended, its value(s) and parameters,
    and why it was pruned or failed. None for a surplus claim (never trained)."""
    if trial.user_attrs.get("surplus"):
        return None
    state = trial.state.name.lower()
    reason = trial.user_attrs.get("fail_reason") or trial.user_attrs.get("prune_reason") or ""
    if state == "fail" and trial.user_attrs.get("interrupted"):
        return f"hookloop tune: trial {trial.number} {reason}; it resumes on a restart"
    if state == "fail":
        why = reason or "ended by another driver (a missed heartbeat), and retried"
        return f"hookloop tune: trial {trial.number} failed: {why} {trial.params}"
    values = trial.values or []
    value = (" value " if len(values) == 1 else " values ") + ", ".join(f"{v:.6g}" for v in values)
    line = f"hookloop tune: trial {trial.number} {state}{value if values else ''}"
    if any(v > 0 for v in trial.user_attrs.get(CONSTRAINT_ATTR) or []):
        line += " (infeasible)"
    return f"{line} {trial.params}" + (f" ({reason})" if reason else "")


def echo_new(study: Any, seen: set[int], out: TextIO | None = None) -> None:
    """Print :func:`trial_line` of each trial finished since the last call."""
    for trial in study.get_trials(deepcopy=False):
        if trial.number in seen or not trial.state.is_finished():
            continue
        seen.add(trial.number)
        line = trial_line(trial)
        if line is not None:
            print(line, file=out or sys.stderr, flush=True)


@contextlib.contextmanager
def optuna_verbosity(verbose: bool) -> Iterator[None]:
    """Optuna at WARNING (INFO when ``verbose``) while a command runs, then as it was."""
    logging = optuna().logging
    before = logging.get_verbosity()
    logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        logging.set_verbosity(before)


def verbosity_for_workers() -> str:
    """This process's Optuna verbosity, for :data:`VERBOSITY_ENV` of its workers."""
    return str(optuna().logging.get_verbosity())


def apply_worker_verbosity(environ: dict[str, str] | None = None) -> None:
    """In a worker: the verbosity its driver passed (left alone when none was)."""
    given = (os.environ if environ is None else environ).get(VERBOSITY_ENV, "")
    if given.isdigit():
        optuna().logging.set_verbosity(int(given))


@contextlib.contextmanager
def trial_output_to_log(path: Path, *, keep: bool = False) -> Iterator[TextIO]:
    """Send what this process prints (Python's ``sys.stdout`` and ``sys.stderr``) to the
    log at ``path`` instead of the terminal (``keep``: to the terminal, as it was). Yields
    the terminal's stream, for the one line per trial."""
    terminal = sys.stderr
    if keep:
        yield terminal
        return
    log = _LogOnFirstWrite(path)
    out, err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = log
    try:
        yield terminal
    finally:
        sys.stdout, sys.stderr = out, err
        log.close()


class _LogOnFirstWrite(io.TextIOBase):
    """A line-buffered append to ``path``, opened when something is first written: a
    study that stops before any trial (a damaged storage) leaves no empty log behind."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._file is None:
            self.path.parent.mkdir(exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        return self._file.write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()
