"""``GlobalState``: what the seed's forward steps and callbacks receive as ``state``.

It is a view, not a second copy of the run's progress: ``train_state`` reads the
native :class:`hookloop.TrainState` that the loop keeps, so the numbers can never
disagree with what native callbacks see.

>>> from hookloop import Config
>>> state = GlobalState(Config())
>>> state.train_state.step, state.train_state.consumed_train_samples
(0, 0)
>>> timer = state.timers("forward")
>>> timer.start(); timer.stop()
>>> timer.elapsed() >= 0.0
True
"""

from __future__ import annotations

from typing import Any

from hookloop.compat.megatron_bridge.training.loggers import Writers
from hookloop.state import TrainState
from hookloop.timers import Timer, Timers

__all__ = ["GlobalState", "Timer", "Timers", "TrainStateView"]  # Timer(s): the native ones


class TrainStateView:
    """The seed's ``train_state``: progress counters under the seed's names, read-only."""

    __slots__ = ("_native",)

    def __init__(self, native: TrainState) -> None:
        self._native = native

    @property
    def step(self) -> int:
        """Optimizer steps begun (during step N's events it is N)."""
        return self._native.step

    @property
    def consumed_train_samples(self) -> int:
        """Training samples consumed so far, over all ranks."""
        return self._native.samples

    @property
    def floating_point_operations_so_far(self) -> float:
        """Estimated training FLOPs so far (0 when the recipe gives no estimate)."""
        return self._native.flops

    def __repr__(self) -> str:
        return (
            f"TrainStateView(step={self.step}, "
            f"consumed_train_samples={self.consumed_train_samples})"
        )


class GlobalState:
    """``cfg`` (the run's config), ``train_state``, ``timers`` and the two loggers.

    One is shared by the forward step and the callbacks of a run. Until the loop
    starts, ``train_state`` shows a fresh run (all counters zero).
    """

    def __init__(
        self,
        cfg: Any,
        train_state: TrainState | None = None,
        *,
        native_config: Any = None,
        writers: Writers | None = None,
    ) -> None:
        self.cfg = cfg
        #: The hookloop Config the loop runs (``cfg`` itself unless cfg is a ConfigContainer).
        self.native_config = cfg if native_config is None else native_config
        self._writers = writers if writers is not None else Writers()
        self._train_state = TrainStateView(train_state if train_state is not None else TrainState())

    @property
    def train_state(self) -> TrainStateView:
        return self._train_state

    @property
    def tensorboard_logger(self) -> Any:
        """A ``SummaryWriter`` (last rank, when the config enables TensorBoard), else None."""
        return self._writers.tensorboard

    @property
    def wandb_logger(self) -> Any:
        """The ``wandb`` module, its run started (last rank, when enabled), else None."""
        return self._writers.wandb

    def close_loggers(self) -> None:
        """Flush and close the writers opened during the run (the entry points call it)."""
        self._writers.close()

    @property
    def timers(self) -> Any:
        """The run's named timers: the loop's own (``forward-backward``, ``optimizer``, …)
        and any the forward step or callbacks start (:class:`hookloop.timers.Timers`)."""
        return self._train_state._native.timers

    def attach(self, native: TrainState) -> None:
        """Follow the counters of ``native`` (the trainer's state) from now on."""
        self._train_state._native = native

    def __repr__(self) -> str:
        return f"GlobalState(train_state={self._train_state!r})"
