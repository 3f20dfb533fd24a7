"""One writer per run directory: an OS file lock held while ``train()`` runs.

Two processes training into one directory would interleave their logs and
delete each other's checkpoint staging. ``train()`` therefore takes an
exclusive ``flock`` on ``<run>/.lock`` (global rank 0 only, under torchrun)
and writes its pid and host into it. The kernel drops the lock when the
process dies however it dies, so a lock is never stuck; a file still naming a
process that is gone only tells us the last holder did not clean up, which is
said once when the lock is taken over.

The lock is re-entrant within one process: several Trainers may train one
after another, or one inside another, in the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hookloop.distributed import broadcast_object
from hookloop.rundir import LOCK_FILE, RunDir

log = logging.getLogger("hookloop.runlock")

_held: dict[Path, list[int]] = {}  # resolved directory -> [fd, depth], this process only


class RunDirLocked(RuntimeError):
    """Another process is training into this run directory."""


@contextlib.contextmanager
def run_lock(directory: str | Path) -> Iterator[None]:
    """Hold the run directory's lock for the ``with`` block (re-entrant in one process)."""
    key = Path(directory).resolve()
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    key.mkdir(parents=True, exist_ok=True)
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise RunDirLocked(
            f"{directory} is in use by another hookloop run ({_describe(holder)}); "
            "two writers would corrupt it: wait for that run to end, stop it, or choose "
            "another --out"
        ) from None
    previous = _read(fd)
    if previous:
        log.warning(
            "hookloop: taking over the lock of %s from %s, which ended without releasing it",
            directory,
            _describe(previous),
        )
    _write(fd, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        _write(fd, None)  # an empty file: released in an orderly way
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def lock_run(
    run: RunDir | None, rank: int, world_size: int
) -> contextlib.AbstractContextManager[Any]:
    """The lock ``train()`` holds on ``run`` (nothing without a run directory): global rank
    0 takes it, and every rank learns whether it could (each then raises the same error)."""
    if run is None:
        return contextlib.nullcontext()
    stack, error = contextlib.ExitStack(), None
    if rank == 0:
        try:
            stack.enter_context(run_lock(run.root))
        except RunDirLocked as err:
            error = str(err)
    if world_size > 1:
        error = broadcast_object(error)
    if error is not None:
        raise RunDirLocked(error)
    return stack


def holder(directory: str | Path) -> dict[str, Any] | None:
    """Who holds (or last held without releasing) the lock of ``directory``, if anyone."""
    path = Path(directory) / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        return _read(fd)
    finally:
        os.close(fd)


def _read(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 4096)
    try:
        found = json.loads(data) if data.strip() else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _write(fd: int, info: dict[str, Any] | None) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    if info is not None:
        os.write(fd, json.dumps(info).encode())
    os.fsync(fd)


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "a process that did not record itself"
    since = info.get("since")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since))
        if isinstance(since, (int, float))
        else ""
    )
    return f"pid {info.get('pid')} on host {info.get('host')}{when}"
