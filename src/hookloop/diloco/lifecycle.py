"""How a DiLoCo server holds its output directory and stops on a signal.

Two servers saving into one ``--output-dir`` would rotate away each other's
checkpoints and, restarted, continue from each other's rounds. A server therefore
holds the native trainer's run-directory lock (:mod:`hookloop.runlock`: an OS
``flock`` on ``<output_dir>/.lock`` naming its pid and host, dropped by the kernel
however the process ends) while it serves; a second server on the directory, in
another process or in this one, is refused in one line naming the holder.

SIGINT and SIGTERM save the current round before the server stops
(:func:`serve_until_signal`): a server saving every ten rounds would otherwise lose up
to nine of them, silently. ``hookloop diloco serve`` then exits 128 + the signal's
number (130, 143), as ``hookloop train`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from hookloop.control.service import one_line
from hookloop.runlock import RunDirLocked, holder, run_lock

log = logging.getLogger("hookloop.diloco")

_serving: set[Path] = set()  # output directories a server of this process serves


class OutputDirLocked(RunDirLocked):
    """Another DiLoCo server serves from this output directory."""


def _refusal(output_dir: str | Path, who: str) -> OutputDirLocked:
    return OutputDirLocked(
        f"output dir {output_dir} is in use by another DiLoCo server ({who}); two servers "
        "would overwrite each other's checkpoints: stop that one, or give this one another "
        "--output-dir"
    )


@contextlib.contextmanager
def hold_output_dir(output_dir: str | Path) -> Iterator[None]:
    """Hold ``output_dir`` for one server for the ``with`` block, or raise
    :class:`OutputDirLocked` naming who holds it."""
    key = Path(output_dir).resolve()
    if key in _serving:
        raise _refusal(output_dir, "in this process")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(run_lock(key))
        except RunDirLocked:
            found = holder(key) or {}
            who = f"pid {found.get('pid')} on host {found.get('host')}"
            raise _refusal(output_dir, who) from None
        _serving.add(key)
        try:
            yield
        finally:
            _serving.discard(key)


async def serve_until_signal(
    serve: Callable[[], Awaitable[None]], on_signal: Callable[[int], None]
) -> int | None:
    """``await serve()``, where the first SIGINT or SIGTERM calls ``on_signal(signum)``
    (which saves and asks the server to stop; later signals wait for that). Returns the
    signal's number, or None when the server stopped otherwise."""
    loop = asyncio.get_running_loop()
    caught: list[int] = []

    def first(signum: int) -> None:
        if not caught:
            caught.append(signum)
            on_signal(signum)

    handled = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, first, signum)  # the main thread only
            handled.append(signum)
    try:
        await serve()
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
    return caught[0] if caught else None


def save_then_stop(server: Any, signum: int) -> None:
    """SIGINT/SIGTERM: save the round reached (unless saving is off), then stop serving."""
    name, done = signal.Signals(signum).name, server.rounds.sync_round
    log.warning("diloco: %s at round %d: saving, then stopping", name, done)
    if server.save_every_n_rounds > 0 and server.running:
        try:
            server.save_state()
        except Exception as err:  # the stop goes on; the checkpoint before stays newest
            log.error("diloco: saving round %d failed (%s)", done, one_line(err))
    server.request_stop()
