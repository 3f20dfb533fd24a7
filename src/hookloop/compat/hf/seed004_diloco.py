"""Seed 004's ``DiLoCoCallback``: a training run as one worker of a DiLoCo server.

The seed's class takes ``(server_addr, sync_every, worker_id, bf16_comm, dylu,
heartbeat_interval, num_fragments, timeout, max_sync_retries)`` with
``DILOCO_*`` environment fallbacks, is a no-op without a server, keeps its
counters in checkpoints and adds its sync metrics to the logs. hookloop's
native :class:`hookloop.diloco.callback.DiLoCoCallback` has exactly that
constructor, so the seed's name is the native class; it works in the HF
dialect's ``Trainer`` like any native callback. The server is
``hookloop diloco serve`` (:mod:`hookloop.diloco.server`).
"""

from __future__ import annotations

from hookloop.diloco.callback import DiLoCoCallback

__all__ = ["DiLoCoCallback"]
