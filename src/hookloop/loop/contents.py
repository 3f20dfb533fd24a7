"""What a checkpoint of the native loop holds: :class:`CheckpointContents`.

Given exactly the objects it names, once they are built; the
:class:`~hookloop.checkpoint.checkpointer.Checkpointer` asks it for them by name at
each save, resume and rewind. The names are the file format (``tests/data/checkpoint_v0``
resumes bitwise): they never change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hookloop.checkpoint.rewind import Rewinder
from hookloop.checkpoint.state import CallbackStates, DictState, RNGState
from hookloop.data import DataPosition
from hookloop.loop.live import LiveSettings
from hookloop.loop.logbook import LossWindow
from hookloop.loop.records import Trained
from hookloop.manager import CallbackManager
from hookloop.precision import Precision
from hookloop.state import TrainState


@dataclass(frozen=True)
class CheckpointContents:
    """Every state a checkpoint holds, each under its name: ``model``, ``optimizer``,
    ``scheduler`` (when there is one; from ``trained``), ``train_state`` (``state``),
    ``scaler`` (``precision``), ``user_state`` and ``callbacks`` (from ``callbacks``),
    ``data`` (``position``), ``log_pending``, ``rewind``, ``settings`` and ``rng``."""

    trained: Trained
    state: TrainState
    precision: Precision
    callbacks: CallbackManager
    position: DataPosition
    log_pending: LossWindow
    rewind: Rewinder
    settings: LiveSettings
    #: The generators' state; one object, so a resume may hold it back (RNGState.hold).
    rng: RNGState = field(default_factory=RNGState)

    @property
    def model(self) -> torch.nn.Module:
        return self.trained.model

    def named(self, *, strict: bool) -> dict[str, Any]:
        """The states by name, in the order they are loaded: the RNG last, so nothing
        restored after it draws. ``strict``: a callback's saved state must find its
        callback (``checkpoint.strict``)."""
        trained, callbacks = self.trained, self.callbacks
        named: dict[str, Any] = {"model": trained.model, "optimizer": trained.optimizer}
        if trained.scheduler is not None:
            named["scheduler"] = trained.scheduler
        named |= {
            "train_state": self.state,
            "scaler": self.precision,
            "user_state": DictState(callbacks.user_state),
            "callbacks": CallbackStates(callbacks.stateful_callbacks(), strict=strict),
            "data": self.position,
            "log_pending": self.log_pending,
            "rewind": self.rewind,
            "settings": self.settings,
            "rng": self.rng,
        }
        return named
