"""The HPO trainer's built-ins whose constructor or numbers differ from hookloop's.

- :class:`EarlyStoppingCallback`: the HPO trainer's defaults (``val_loss``,
  patience 20, ``min_delta=1e-4``) and its reading of ``min_delta`` as *relative*
  (1e-4 = 0.01 % better than the best), from :class:`EarlyStoppingConfig`
  (the HPO trainer's ``early_stopping_config``) or keywords. Its state loads
  from hookloop's checkpoints and from the HPO trainer's own
  (``counter``, ``best_value``, ``should_stop``);
- :class:`CheckpointCallback`: ``save_every_n_epochs``, ``keep_last_k`` and the
  best checkpoint by ``monitor``. Given ``checkpoint_dir`` it saves there itself
  (in a loop you write and drive with ``CallbackRunner.fire``, and inside a
  hookloop Trainer alike), through hookloop's
  :class:`~hookloop.checkpoint.CheckpointManager`, keeping the newest
  ``keep_last_k`` and the best. Without ``checkpoint_dir``, inside a hookloop
  Trainer, it asks the loop for saves and the run's ``checkpoint.*`` keys keep them.

Both are native hookloop callbacks (subclasses of the native ones), so
``runner.native()`` passes them through; ``fire`` drives them through
:mod:`hookloop.compat.hpo.faces`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hookloop.callbacks.checkpoint_policy import CheckpointPolicy
from hookloop.callbacks.early_stopping import EarlyStopping
from hookloop.callbacks.monitor import as_float, check_metric_name, check_mode
from hookloop.compat.hpo.direct import HpoHooks
from hookloop.state import CallbackContext

#: The HPO trainer calls the evaluation loss ``val_loss``; a hookloop Trainer reports ``eval_loss``.
HPO_TO_NATIVE_METRIC = {"val_loss": "eval_loss"}

#: The keys of early-stopping state as the HPO trainer saves it.
HPO_EARLY_STOPPING_KEYS = ("counter", "best_value", "should_stop")


def native_metric(name: str) -> str:
    return HPO_TO_NATIVE_METRIC.get(name, name)


def __getattr__(name: str) -> Any:
    if name == "SEED_TO_NATIVE_METRIC":
        warnings.warn(
            "hookloop.compat.hpo.builtins.SEED_TO_NATIVE_METRIC is now HPO_TO_NATIVE_METRIC",
            DeprecationWarning,
            stacklevel=2,
        )
        return HPO_TO_NATIVE_METRIC
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _renamed_monitor(self: Any) -> str | None:
    """The old name of ``hpo_monitor``, kept one release with a ``DeprecationWarning``."""
    warnings.warn(
        f"{type(self).__name__}.seed_monitor is now hpo_monitor", DeprecationWarning, stacklevel=2
    )
    return self.hpo_monitor


@dataclass
class EarlyStoppingConfig:
    """The HPO trainer's ``early_stopping_config``: ``enabled``, ``patience``, ``mode``,
    ``min_delta``.

    ``min_delta`` is relative: an evaluation improves when it beats the best by
    more than ``min_delta * |best|``.
    """

    enabled: bool = True
    patience: int = 20
    mode: str = "min"
    min_delta: float = 1e-4
    monitor: str = "val_loss"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(
                f"early_stopping_config.enabled must be true or false, got {self.enabled!r}"
            )
        patience = self.patience
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"early_stopping_config.patience must be an int >= 1, got {patience!r}"
            )
        check_mode(self.mode, "early_stopping_config.mode")
        delta = self.min_delta
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta < 1:
            raise ValueError(
                f"early_stopping_config.min_delta must be a fraction in [0, 1) (relative: "
                f"1e-4 = 0.01 %), got {delta!r}"
            )
        check_metric_name(self.monitor, "early_stopping_config.monitor")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> EarlyStoppingConfig:
        """From the YAML mapping (unknown keys are refused, naming the allowed ones)."""
        data = dict(data or {})
        allowed = {"enabled", "patience", "mode", "min_delta", "monitor"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(
                f"early_stopping_config has unknown keys {unknown}; allowed: {sorted(allowed)}"
            )
        return cls(**data)


def early_stopping_from_config(
    config: EarlyStoppingConfig | Mapping[str, Any] | None,
) -> EarlyStoppingCallback | None:
    """The callback a run config asks for, or None when ``enabled`` is false."""
    if not isinstance(config, EarlyStoppingConfig):
        config = EarlyStoppingConfig.from_dict(config)
    if not config.enabled:
        return None
    return EarlyStoppingCallback(
        monitor=config.monitor,
        mode=config.mode,
        patience=config.patience,
        min_delta=config.min_delta,
    )


class EarlyStoppingCallback(HpoHooks, EarlyStopping):
    """The HPO trainer's early stopping: ``should_stop`` after ``patience`` evaluations
    without a relative improvement of more than ``min_delta`` (1e-4 = 0.01 %).

    ``monitor="val_loss"`` is the evaluation loss (``eval_loss`` inside a hookloop
    Trainer). ``state_dict()`` holds hookloop's state and, beside it, the HPO
    trainer's three keys (``counter``, ``best_value``, ``should_stop``), so either
    trainer can read it; ``load_state_dict`` reads either shape and refuses any other.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "min",
        patience: int = 20,
        min_delta: float = 1e-4,
    ) -> None:
        self.hpo_monitor = check_metric_name(monitor)
        super().__init__(native_metric(monitor), mode, patience, min_delta, threshold_mode="rel")

    @classmethod
    def from_config(
        cls, config: EarlyStoppingConfig | Mapping[str, Any] | None
    ) -> EarlyStoppingCallback | None:
        return early_stopping_from_config(config)

    seed_monitor = property(_renamed_monitor)

    @property
    def counter(self) -> int:
        """Evaluations since the last improvement (the HPO trainer's ``counter``)."""
        return self.trackers[self.monitor].bad_count

    @property
    def best_value(self) -> float | None:
        """The best value so far (the HPO trainer's ``best_value``); None before the first."""
        return self.trackers[self.monitor].best

    def state_dict(self) -> dict[str, Any]:
        tracker = self.trackers[self.monitor]
        return {
            **super().state_dict(),
            "counter": tracker.bad_count,
            "best_value": tracker.best,
            "should_stop": self.should_stop,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore hookloop's state (``trackers``) or the HPO trainer's (``counter``,
        ``best_value``, ``should_stop``); any other shape is refused, naming its keys."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"EarlyStoppingCallback state must be a dict, got {type(state).__name__}"
            )
        if "trackers" in state:
            super().load_state_dict(dict(state))
            if isinstance(state.get("should_stop"), bool):
                self.should_stop = state["should_stop"]
            return
        if set(HPO_EARLY_STOPPING_KEYS) <= set(state):
            self._load_hpo_state(state)
            return
        raise ValueError(
            f"EarlyStoppingCallback cannot load a state with keys {sorted(map(str, state))}: "
            f"it reads hookloop's ('trackers', 'best_steps') or the HPO trainer's "
            f"{list(HPO_EARLY_STOPPING_KEYS)}"
        )

    def _load_hpo_state(self, state: Mapping[str, Any]) -> None:
        counter, best, stop = (state[k] for k in HPO_EARLY_STOPPING_KEYS)
        if isinstance(counter, bool) or not isinstance(counter, int) or counter < 0:
            raise ValueError(f"early-stopping state 'counter' must be an int >= 0, got {counter!r}")
        if best is not None and as_float(best) is None:
            raise ValueError(f"early-stopping state 'best_value' must be a number, got {best!r}")
        if not isinstance(stop, bool):
            raise ValueError(f"early-stopping state 'should_stop' must be a bool, got {stop!r}")
        tracker = self.trackers[self.monitor]
        tracker.best = None if best is None else float(best)
        tracker.bad_count = counter
        tracker.updates = counter + (best is not None)
        self.should_stop = stop


def has_maybe_save(value: object) -> bool:
    """Whether ``value`` is a checkpoint manager of the HPO trainer's kind."""
    return callable(getattr(value, "maybe_save", None))


def _check_manager(manager: Any, checkpoint_dir: Any, keep_last_k: Any) -> Any:
    if manager is None:
        return None
    if not has_maybe_save(manager):
        raise ValueError(
            "checkpoint_manager must have maybe_save(epoch, model, optimizer, scheduler, "
            f"val_loss, metrics, early_stopping_state, config_hash), got {type(manager).__name__}"
        )
    if checkpoint_dir is not None or keep_last_k is not _KEEP_LAST_DEFAULT:
        raise ValueError(
            "CheckpointCallback(checkpoint_manager, config_hash) leaves where and how many "
            "to keep to the manager: pass checkpoint_dir and keep_last_k to it, not here"
        )
    return manager


class _DefaultKeepLast(int):
    """``keep_last_k``'s default (3): an int that tells a value left out from one given."""


_KEEP_LAST_DEFAULT = _DefaultKeepLast(3)


class HpoCheckpointPolicy(CheckpointPolicy):
    """The HPO trainer's checkpointing as a native callback (:class:`CheckpointCallback`
    adds the HPO trainer's hooks). Two forms:

    ``CheckpointCallback(checkpoint_manager, config_hash="")``, the HPO trainer's: at
    the end of each epoch it calls ``checkpoint_manager.maybe_save(epoch, model,
    optimizer, scheduler, val_loss, metrics, early_stopping_state, config_hash)``, so
    the HPO trainer's own ``CheckpointManager`` decides what to write and where
    (``early_stopping_state`` is the first :class:`EarlyStoppingCallback`'s state).

    ``CheckpointCallback(checkpoint_dir=None, save_every_n_epochs=1, keep_last_k=3,
    monitor="val_loss", mode="min")``: every ``save_every_n_epochs`` epochs, the newest
    ``keep_last_k`` kept, and the best by ``monitor`` kept besides.
    With ``checkpoint_dir`` it saves there itself, at the end of each epoch that is
    due or a new best: model, optimizer, scheduler and the other stateful
    callbacks, as ``step-<epoch number>`` directories of hookloop's
    :class:`~hookloop.checkpoint.CheckpointManager` (atomic; ``latest`` names the
    newest), in a loop you write and inside a hookloop Trainer alike. Without it,
    inside a hookloop Trainer, it asks the loop for saves into the run's
    checkpoints, which the run's ``checkpoint.keep_last`` keeps: a ``keep_last_k``
    given then must equal it (the run refuses to start otherwise, naming both).
    """

    def __init__(
        self,
        checkpoint_dir: str | Path | Any = None,
        save_every_n_epochs: int | str = 1,
        keep_last_k: int | None = _KEEP_LAST_DEFAULT,
        monitor: str | None = "val_loss",
        mode: str = "min",
        *,
        checkpoint_manager: Any = None,
        config_hash: str = "",
    ) -> None:
        if has_maybe_save(checkpoint_dir):  # the HPO trainer's (checkpoint_manager, config_hash)
            if checkpoint_manager is not None:
                raise TypeError("CheckpointCallback got checkpoint_manager twice")
            checkpoint_dir, checkpoint_manager = None, checkpoint_dir
            if isinstance(save_every_n_epochs, str):
                save_every_n_epochs, config_hash = 1, save_every_n_epochs
        #: The HPO trainer's checkpoint manager (the first form); None in the second.
        self.checkpoint_manager = _check_manager(checkpoint_manager, checkpoint_dir, keep_last_k)
        self.config_hash = config_hash
        if keep_last_k is not None and (
            isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or keep_last_k < 1
        ):
            raise ValueError(
                f"keep_last_k must be an int >= 1 or None (keep all), got {keep_last_k!r}"
            )
        if save_every_n_epochs is not None and (
            isinstance(save_every_n_epochs, bool)
            or not isinstance(save_every_n_epochs, int)
            or save_every_n_epochs < 1
        ):
            raise ValueError(
                f"save_every_n_epochs must be an int >= 1 or None, got {save_every_n_epochs!r}"
            )
        super().__init__(
            every_n_epochs=save_every_n_epochs,
            monitor=None if monitor is None else native_metric(monitor),
            mode=mode,
        )
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.save_every_n_epochs = self.every_n_epochs
        self._keep_last_given = keep_last_k is not _KEEP_LAST_DEFAULT
        self.keep_last_k = None if keep_last_k is None else int(keep_last_k)
        self.hpo_monitor = monitor
        self._manager: Any = None
        self._epoch_value: float | None = None
        self._epoch_metrics: dict[str, Any] = {}
        self._missing_warned = False

    seed_monitor = property(_renamed_monitor)

    # -- saving to checkpoint_dir (a hand-written loop, or a Trainer) -----------------
    def directory_manager(self) -> Any:
        """The :class:`~hookloop.checkpoint.CheckpointManager` over ``checkpoint_dir``."""
        if self._manager is not None:
            return self._manager
        from hookloop.checkpoint import CheckpointManager, SavePolicy

        if self.checkpoint_dir is None:
            raise ValueError(
                "CheckpointCallback needs checkpoint_dir=... in a loop driven by "
                "CallbackRunner.fire (inside a hookloop Trainer the run directory is used)"
            )
        policy = SavePolicy(
            every=None,
            keep_last=self.keep_last_k,
            save_on_end=False,
            monitor="val_loss" if self.monitor else None,
            mode=self.mode,
            keep_best=1,
        )
        self._manager = CheckpointManager(self.checkpoint_dir, policy)
        return self._manager

    def save_epoch(self, state: Mapping[str, Any], epoch: int, value: float | None) -> Path | None:
        """The end of 0-based ``epoch`` whose monitored value is ``value``: save ``state`` to
        ``checkpoint_dir`` when the epoch is due or a new best; the path, or None."""
        number = epoch + 1
        best = self.monitor is not None and value is not None and self.tracker.update(value)
        periodic = bool(self.every_n_epochs) and number % self.every_n_epochs == 0
        if not (best or periodic):
            return None
        metrics = {"val_loss": value} if value is not None else {}
        path = self.directory_manager().save(state, step=number, epoch=epoch, metrics=metrics)
        if best and path is not None:
            self.best_path, self.best_step = str(path), number
        return path

    def manager_save(
        self, holder: Any, epoch: int, val_loss: Any, metrics: Any, peers: Any = ()
    ) -> None:
        """The HPO trainer's save: ``checkpoint_manager.maybe_save(...)`` for 0-based
        ``epoch``, with ``holder``'s model, optimizer and scheduler and the state of the
        first :class:`EarlyStoppingCallback` among ``peers``."""
        early_stopping_state = next(
            (cb.state_dict() for cb in peers if isinstance(cb, EarlyStoppingCallback)), None
        )
        self.checkpoint_manager.maybe_save(
            epoch,
            holder.model,
            holder.optimizer,
            getattr(holder, "scheduler", None),
            val_loss,
            metrics,
            early_stopping_state,
            self.config_hash,
        )

    # -- inside a hookloop Trainer -----------------------------------------------------
    def on_train_start(self, ctx: CallbackContext) -> None:
        if self.checkpoint_dir is not None or self.checkpoint_manager is not None:
            self._epoch_value = None
            return
        cfg = getattr(ctx.config, "checkpoint", None)
        keep_last = getattr(cfg, "keep_last", None)
        if self._keep_last_given and cfg is not None and keep_last != self.keep_last_k:
            raise ValueError(
                f"CheckpointCallback(keep_last_k={self.keep_last_k}) without checkpoint_dir "
                f"saves into the run's checkpoints, which checkpoint.keep_last={keep_last} "
                f"keeps: pass checkpoint_dir=... or set checkpoint.keep_last={self.keep_last_k}"
            )
        super().on_train_start(ctx)

    def evaluated(self, ctx: CallbackContext, metrics: Mapping[str, Any]) -> None:
        """With a manager or ``checkpoint_dir``, the value is kept for the epoch's end,
        which decides; without, a new best asks the run for a save (the native way)."""
        if self.checkpoint_manager is not None:
            self._epoch_value = as_float(metrics.get("eval_loss"))
            self._epoch_metrics = dict(metrics)
            return
        if self.checkpoint_dir is None:
            super().evaluated(ctx, metrics)
            return
        if self.monitor is None:
            return
        value = as_float(metrics.get(self.monitor))
        if value is None and not self._missing_warned:
            self._missing_warned = True
            warnings.warn(
                f"CheckpointCallback: monitor {self.monitor!r} is not among the evaluation "
                f"metrics {sorted(metrics)}; only the periodic checkpoints are saved",
                stacklevel=2,
            )
        if value is not None:
            self._epoch_value = value

    def epoch_ended(self, ctx: CallbackContext) -> None:
        """The HPO trainer's save point: ``maybe_save`` of its manager, or a save to
        ``checkpoint_dir`` when due or a new best; without either, the native request.
        (The run's saves and ``every_n_steps`` are then this callback's only without them:
        neither form marks a best for the run's checkpoints nor saves by steps.)"""
        if self.checkpoint_manager is not None:
            trainer = ctx.trainer
            peers = trainer.callbacks.callbacks if trainer is not None else ()
            value, self._epoch_value = self._epoch_value, None
            self.manager_save(ctx, ctx.state.epoch, value, self._epoch_metrics, peers)
            return
        if self.checkpoint_dir is None:
            super().epoch_ended(ctx)
            return
        value, self._epoch_value = self._epoch_value, None
        self.save_epoch(self._run_state(ctx), ctx.state.epoch, value)

    def _run_state(self, ctx: CallbackContext) -> dict[str, Any]:
        from hookloop.checkpoint import CallbackStates

        state: dict[str, Any] = {"model": ctx.model, "optimizer": ctx.optimizer}
        if ctx.scheduler is not None and hasattr(ctx.scheduler, "state_dict"):
            state["scheduler"] = ctx.scheduler
        trainer = ctx.trainer
        peers = trainer.callbacks.stateful_callbacks() if trainer is not None else {}
        stateful = {name: cb for name, cb in peers.items() if cb is not self}
        if stateful:
            state["callbacks"] = CallbackStates(stateful)
        return state


class CheckpointCallback(HpoHooks, HpoCheckpointPolicy):
    """The HPO trainer's ``CheckpointCallback`` (see :class:`HpoCheckpointPolicy`), whose
    hooks can also be called as the HPO trainer's: ``cb.on_epoch_end(trainer, epoch=...)``."""
