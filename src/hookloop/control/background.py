"""One small aiohttp helper shared by the control server and the DiLoCo server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


def run_while_serving(app: Any, job: Callable[[], Awaitable[None]]) -> None:
    """Start ``job()`` on the running loop and cancel it when ``app`` is cleaned up.

    Call it from an ``on_startup`` handler; ``job`` is a loop that never returns
    by itself (a sampler, a reaper)."""
    task = asyncio.get_running_loop().create_task(job())

    async def cancel(_app: Any) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.on_cleanup.append(cancel)
