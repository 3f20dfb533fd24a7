"""What always travels together between the parts of the loop, one record per meaning.

- :class:`Events`: the run's event channel (the context handlers receive, the live index
  of handlers per event, the call that runs them). Handlers ask through ``ctx.control``.
- :class:`Trained`: what training changes (the model, as given and as the step runs it,
  its optimizer and LR scheduler).
- :class:`Compute`: how a batch is computed (the forward step, the read-only state it is
  handed first, the precision and the device).
- :class:`LoopTiming`: the clock the loop reads at step boundaries and its named timers.

Each part takes the records it uses, and copies the fields it reads on the hot path
into its own attributes (one attribute lookup, as before the records existed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hookloop.precision import Precision
from hookloop.requests import Control
from hookloop.state import CallbackContext, TrainState


@dataclass(frozen=True)
class Events:
    """The run's event channel: ``fire(event, ctx)`` runs an event's handlers with
    ``ctx``; ``hooks[event]`` (live: it follows callbacks added and removed) says whether
    there are any, so a part builds an event's payload only when someone handles it."""

    ctx: CallbackContext
    hooks: Mapping[str, Sequence[Any]]
    fire: Callable[[str, CallbackContext], None]

    def emit(self, event: str) -> None:
        """``event``'s handlers with ``ctx``, when it has any."""
        if self.hooks[event]:
            self.fire(event, self.ctx)

    @property
    def control(self) -> Control:
        """Where handlers file their requests (``ctx.control``)."""
        return self.ctx.control


@dataclass(frozen=True)
class Trained:
    """What training changes: ``model`` as the user gave it (never wrapped; callbacks
    and checkpoints see it), ``train_model`` as the step runs it (DDP-wrapped,
    FSDP2-sharded or compiled, else the model itself), the optimizer and the LR
    scheduler (None: a constant rate)."""

    model: torch.nn.Module
    train_model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any = None


@dataclass(frozen=True)
class Compute:
    """How a batch is computed: ``forward(state, data_iterator, model)`` (the user's
    forward step, bound), handed the read-only ``state`` first, under ``precision``'s
    autocast, on ``device``."""

    forward: Callable[..., Any]
    state: TrainState | None
    precision: Precision
    device: torch.device


@dataclass(frozen=True)
class LoopTiming:
    """The clock the loop reads once per step boundary (``train.timers``: the host's,
    one that waits for the device first, or none) and the loop's own timers by name
    (:data:`hookloop.timers.LOOP_TIMERS`; no-ops when timing is off)."""

    clock: Callable[[], float]
    timers: Mapping[str, Any]  # a Timer, or NULL_TIMER
