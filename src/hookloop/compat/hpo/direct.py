"""The HPO trainer's built-ins, callable as the HPO trainer's own: ``cb.on_val_end(trainer, ...)``.

The HPO trainer's built-ins are ``TrainingCallback`` objects: its tests, and loops
written for it, call their hooks directly
(``cb.on_epoch_end(trainer=t, epoch=0, train_loss=0.5, val_loss=0.4, metrics={})``)
and read the results off the callback and the trainer. hookloop's classes under
those names are native callbacks, so a hookloop Trainer runs them as they are;
:class:`HpoHooks` gives them the seven HPO-trainer hooks besides, with the HPO
trainer's arguments, worked by the built-in's face (:mod:`hookloop.compat.hpo.faces`):

>>> from types import SimpleNamespace
>>> nan = NaNDetectionCallback()
>>> nan.on_epoch_end(trainer=SimpleNamespace(), epoch=3, train_loss=float("nan"),
...                  val_loss=0.5, metrics={})
>>> nan.nan_detected
True

Three hook names are also hookloop events (``on_train_step_end``, ``on_epoch_end``,
``on_train_end``): called with a hookloop ``CallbackContext`` they run the native
hook, called any other way the HPO trainer's. The other four
(``on_train_begin``, ``on_train_epoch_begin``, ``on_val_begin``, ``on_val_end``)
are looked up through ``__getattr__``, so a hookloop Trainer, which refuses a
callback method that names none of its events, never sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from hookloop._optional import require
from hookloop.callbacks import (
    grad_monitor,
    loss_prediction,
    nan_detection,
    optimizer_mode,
    optuna_pruning,
    overfit,
    wandb_logger,
)
from hookloop.callbacks.monitor import as_float
from hookloop.compat.hpo.callback import EVENTS
from hookloop.compat.hpo.faces import face_for
from hookloop.events import EVENT_NAMES
from hookloop.state import CallbackContext

#: The HPO trainer's hooks that are not hookloop events (served by ``__getattr__``).
HPO_ONLY_HOOKS = frozenset(EVENTS) - frozenset(EVENT_NAMES)


class HpoHooks:
    """The seven HPO-trainer hooks on a native built-in, for calls made directly.

    Mixed in before the native class. The hooks run the built-in's face, one per
    callback (a :class:`~hookloop.compat.hpo.CallbackRunner` firing the callback
    uses the same one), which keeps its results on the callback itself
    (``nan_detected``, ``should_stop`` ...) and on the trainer (``trainer._<name>``).
    """

    #: The key of the callback's state in checkpoints when it is the native class's
    #: (the native class and its HPO-trainer name then resume each other's runs).
    checkpoint_key: ClassVar[str | None] = None

    @property
    def name(self) -> str:
        return self.checkpoint_key or super().name  # type: ignore[misc]  # a mixin: Callback.name

    def hpo_face(self, peers: Sequence[Any] = ()) -> Any:
        """This callback's face (made on first use; ``peers`` are the callbacks beside it)."""
        face = self.__dict__.get("_hpo_face")
        if face is None:
            face = self.__dict__["_hpo_face"] = face_for(self, peers)  # type: ignore[arg-type]  # mixed into a Callback
        if peers:
            face.peers = peers
        return face

    def __getattr__(self, name: str) -> Any:
        if name in HPO_ONLY_HOOKS:
            return getattr(self.hpo_face(), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def on_train_step_end(self, *args: Any, **fields: Any) -> None:
        self._either("on_train_step_end", args, fields)

    def on_epoch_end(self, *args: Any, **fields: Any) -> None:
        self._either("on_epoch_end", args, fields)

    def on_train_end(self, *args: Any, **fields: Any) -> None:
        self._either("on_train_end", args, fields)

    def _either(self, event: str, args: tuple[Any, ...], fields: dict[str, Any]) -> None:
        """hookloop's loop passes one ``CallbackContext``; anything else is an HPO-trainer call."""
        if len(args) == 1 and not fields and isinstance(args[0], CallbackContext):
            getattr(super(), event)(args[0])
        else:
            getattr(self.hpo_face(), event)(*args, **fields)


class NaNDetectionCallback(HpoHooks, nan_detection.NaNDetection):
    """NaN detection; ``nan_detected`` after an epoch whose train or val loss is NaN."""


class OptimizerModeCallback(HpoHooks, optimizer_mode.OptimizerMode):
    """``optimizer.train()`` / ``optimizer.eval()`` for optimizers that have them."""


class GradientMonitorCallback(HpoHooks, grad_monitor.GradientMonitor):
    """Each epoch's largest gradient norm, as ``trainer._max_grad_norm``."""

    checkpoint_key = "GradientMonitor"


class LossPredictionCallback(HpoHooks, loss_prediction.LossPrediction):
    """``LossPredictionCallback(max_epochs)``: ``trainer._loss_prediction`` from epoch 10."""

    checkpoint_key = "LossPrediction"


class OverfitDetectionCallback(HpoHooks, overfit.OverfitDetection):
    """Train loss falling while val loss rises: ``trainer._overfit_gap_ratio``."""

    checkpoint_key = "OverfitDetection"


class WandbLoggingCallback(HpoHooks, wandb_logger.WandbLoggingCallback):
    """One W&B row per epoch, as the HPO trainer logs it."""


class PrunerCallback(HpoHooks, optuna_pruning.OptunaPruning):
    """Optuna pruning, in either of two forms.

    - ``PrunerCallback(pruner, trial, seed)``, the HPO trainer's: after each
      evaluation, ``pruner.report(trial_id=trial.number, seed=seed, epoch=epoch,
      value=val_loss)``; when ``pruner.should_prune()`` says so, ``optuna.TrialPruned``
      is raised. ``pruner`` is the HPO trainer's own kind of pruner (its ``PFLPruner``
      or anything with those two methods); with ``pruner`` or ``trial`` None nothing
      is reported.
    - ``PrunerCallback(trial, monitor="eval_loss", *, raise_pruned=True,
      report_step="step")``: an Optuna trial, reported to directly
      (:class:`~hookloop.callbacks.OptunaPruning`).
    """

    checkpoint_key = "OptunaPruning"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Whether this is the HPO trainer's form, with its pruner and the run's seed.
        self.pruner_form = _is_pruner_form(args, kwargs)
        self.pruner: Any = None
        self.seed: Any = None
        if not self.pruner_form:
            super().__init__(*args, **kwargs)
            return
        pruner, trial, seed = _pruner_form(args, kwargs)
        # The fields the native hooks and faces read; the pruner decides, not the trial.
        self.pruner, self.trial, self.seed = pruner, trial, seed
        self.monitor, self.raise_pruned, self.report_step = "eval_loss", True, "eval"
        self.pruned, self.evaluations, self._warned_missing = False, 0, False

    def report_to_pruner(self, epoch: int, value: Any) -> None:
        """The HPO trainer's report: to its pruner, then ``optuna.TrialPruned`` if it says so."""
        if self.pruner is None or self.trial is None:
            return
        self.pruner.report(trial_id=self.trial.number, seed=self.seed, epoch=epoch, value=value)
        if self.pruner.should_prune():
            self.pruned = True
            raise _optuna().TrialPruned(
                f"{optuna_pruning.REASON_PREFIX} trial {self.trial.number} pruned by "
                f"{type(self.pruner).__name__} at epoch {epoch} (val_loss={value})"
            )

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not self.pruner_form:
            super().on_eval_end(ctx)
            return
        if not ctx.state.in_training or ctx.metrics is None or not ctx.state.is_rank_zero:
            return
        value = as_float(ctx.metrics.get(self.monitor))
        if value is not None:
            self.report_to_pruner(ctx.state.epoch, value)

    def __repr__(self) -> str:
        if not self.pruner_form:
            return super().__repr__()
        return (
            f"PrunerCallback({type(self.pruner).__name__}, "
            f"trial={getattr(self.trial, 'number', None)}, seed={self.seed!r})"
        )


_PRUNER_FORM = "PrunerCallback(pruner, trial, seed)"


def _optuna() -> Any:
    return require("optuna", extra="optuna", feature="PrunerCallback")


def _is_pruner_form(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Three arguments, ``pruner=``/``seed=``, or a first argument that is a pruner, not a trial."""
    if len(args) == 3 or "pruner" in kwargs or "seed" in kwargs:
        return True
    first = args[0] if args else None
    return (
        first is not None
        and callable(getattr(first, "should_prune", None))
        and not isinstance(first, _optuna().trial.BaseTrial)
    )


def _pruner_form(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    names = ("pruner", "trial", "seed")
    if len(args) > 3 or set(kwargs) - set(names):
        raise TypeError(f"{_PRUNER_FORM} takes exactly pruner, trial and seed")
    given = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name in given:
            raise TypeError(f"{_PRUNER_FORM} got {name} twice")
        given[name] = value
    missing = [name for name in names if name not in given]
    if missing:
        raise TypeError(f"{_PRUNER_FORM} is missing {', '.join(missing)}")
    pruner = given["pruner"]
    if pruner is not None and not (
        callable(getattr(pruner, "report", None))
        and callable(getattr(pruner, "should_prune", None))
    ):
        raise ValueError(
            f"{_PRUNER_FORM}: pruner must have report(trial_id=, seed=, epoch=, value=) and "
            f"should_prune() (the HPO trainer's PFLPruner), got {type(pruner).__name__}"
        )
    return pruner, given["trial"], given["seed"]
