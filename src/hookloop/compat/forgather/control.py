"""Forgather's trainer control under its names: the callback a job serves with, the client
hookloop's CLI uses, and where jobs are announced (hookloop's registry and Forgather's two,
see :mod:`hookloop.control.registry`). All of it is :mod:`hookloop.control`, which speaks
Forgather's protocol."""

from __future__ import annotations

from hookloop.control import ControlServer, JobClient, TrainerControlCallback, list_jobs
from hookloop.control.registry import forgather_jobs_dirs, registries

__all__ = [
    "ControlServer",
    "JobClient",
    "TrainerControlCallback",
    "forgather_jobs_dirs",
    "list_jobs",
    "registries",
]
