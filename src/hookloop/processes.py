"""Whether a process still runs, from its pid: one answer for every part that asks.

``hookloop runs`` asks it of the process named in a run's last ``start`` record,
``hookloop jobs`` of a job's registry entry, ``hookloop tune`` of a trial's worker.
A zombie (exited, not yet reaped by its parent) is dead here; where the start time
of the process is known, a pid reused by another process is told apart.
Standard library only, so that any layer may import it.
"""

from __future__ import annotations

import os
from pathlib import Path


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state letter, start time in clock ticks since boot)`` from /proc; Linux only."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    try:  # the command name is in parentheses and may itself hold spaces or ')'
        fields = raw[raw.rindex(b")") + 2 :].split()
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (ValueError, IndexError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started, to tell a recycled pid apart (None where unknown)."""
    info = _proc_stat(pid)
    return info[1] if info is not None else None


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not) and, when known, is still the same process."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    info = _proc_stat(pid)
    if info is None:
        return True  # no /proc: trust kill(0)
    state, started = info
    if state in ("Z", "X"):
        return False  # exited, not yet reaped by its parent
    return start_ticks is None or started == start_ticks
