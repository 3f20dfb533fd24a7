"""Process liveness, as ``hookloop runs``, ``hookloop jobs`` and ``hookloop tune`` see it."""

from __future__ import annotations

import os
import subprocess
import sys

from hookloop.processes import process_alive, process_start_ticks


def test_a_running_process_is_alive_and_a_recycled_pid_is_not():
    """A run whose process runs shows as running; another process under its pid does not."""
    pid = os.getpid()
    assert process_alive(pid)
    ticks = process_start_ticks(pid)
    assert process_alive(pid, ticks)
    if ticks is not None:  # Linux: /proc gives the start time
        assert not process_alive(pid, ticks + 1)


def test_an_exited_process_is_dead_before_and_after_its_parent_reaps_it():
    """A killed run shows as killed at once, even while its parent has not yet reaped it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
    assert not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid)


def test_what_is_no_pid_is_never_alive():
    """A damaged record (no pid, 0, a negative number, true) never reads as a live run."""
    for pid in (0, -1, True, None, "123"):
        assert not process_alive(pid)  # type: ignore[arg-type]
