"""Forgather's trainer control under its names: the callback a job serves with and the
client its CLI uses (both :mod:`hookloop.control`, which speaks Forgather's protocol)."""

from __future__ import annotations

from hookloop.control import ControlServer, JobClient, TrainerControlCallback, list_jobs

__all__ = ["ControlServer", "JobClient", "TrainerControlCallback", "list_jobs"]
