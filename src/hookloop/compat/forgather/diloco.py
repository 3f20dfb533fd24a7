"""Forgather's DiLoCo classes under their own names, over :mod:`hookloop.diloco`.

- ``DiLoCoServer``: Forgather's constructor; as in Forgather it admits tokenless
  peers by default (``disable_auth=True``), on loopback only unless
  ``allow_remote_without_auth=True``, and workers that send no worker secret
  (``allow_unbound_workers=True``, each tied to its address); pass ``token=`` to
  require a token (and a secret from every worker).
- ``DiLoCoWorker(model, optimizer, server_addr, ...)``: Forgather's wrapper that
  counts steps with an optimizer post-step hook, usable as a context manager.
- ``DiLoCoClient`` and ``DiLoCoCallback``: hookloop's, which already have
  Forgather's methods and constructor.
"""

from __future__ import annotations

from typing import Any

import torch

from hookloop.diloco.callback import DiLoCoCallback
from hookloop.diloco.client import DiLoCoClient
from hookloop.diloco.server import DiLoCoServer as _Server
from hookloop.diloco.worker import DiLoCoWorker as _Worker

__all__ = ["DiLoCoCallback", "DiLoCoClient", "DiLoCoServer", "DiLoCoWorker"]


class DiLoCoServer(_Server):
    """Forgather's server: tokenless, secret-less peers admitted unless ``token=`` is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("token") is None:
            kwargs.setdefault("disable_auth", True)
            kwargs.setdefault("allow_unbound_workers", True)
        super().__init__(*args, **kwargs)


class DiLoCoWorker(_Worker):
    """Forgather's worker: syncs from ``optimizer``'s post-step hook between start and stop."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, server_addr: str,
        *args: Any, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(model, server_addr, *args, **kwargs)
        self.optimizer = optimizer
        self._hook: Any = None

    def start(self) -> None:
        if self.active:
            return
        super().start()
        self._hook = self.optimizer.register_step_post_hook(lambda *_: self.after_step())

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        super().stop()

    def __enter__(self) -> DiLoCoWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
