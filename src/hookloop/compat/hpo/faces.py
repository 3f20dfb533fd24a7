"""The HPO trainer's nine built-ins in a loop you write: ``CallbackRunner(callbacks).fire(...)``.

The built-ins are native hookloop callbacks (inside a hookloop Trainer they
read ``ctx``). In the HPO trainer's own loop there is no ``ctx``: the trainer fires
seven events with keyword fields, and the built-ins talk through
``trainer._<name>`` attributes. For each built-in a *face* gives the HPO trainer's
hooks, worked out from the fields and the trainer (``trainer.model``,
``trainer.optimizer``) as the original HPO trainer's built-in does (with the
native callback's pure helpers wherever their numbers agree), and keeps its
results on the native object (``nan_detected``, ``should_stop``,
``epoch_maxima``, ``prediction``, ``gap_ratio``, ``pruned`` …):

=========================  =====================  =========================================
built-in                   hooks                  effect
=========================  =====================  =========================================
NaNDetectionCallback       on_epoch_end           ``nan_detected`` when train/val loss is NaN
OptimizerModeCallback      epoch begin, val begin ``optimizer.train()`` / ``optimizer.eval()``
GradientMonitorCallback    epoch begin, step end, ``trainer._max_grad_norm``: the epoch's
                           epoch end              largest gradient L2 norm; warns above the
                                                  threshold
LossPredictionCallback     on_val_end             ``trainer._loss_prediction`` from epoch 10:
                                                  -log10 of the loss a line through
                                                  log(val_loss) against 0, 1, 2 … gives at
                                                  ``t = max_epochs``
OverfitDetectionCallback   on_epoch_end           ``trainer._overfit_gap_ratio`` (or None)
                                                  over the last ``window_size`` values
WandbLoggingCallback       begin, epoch end, end  one W&B row per epoch (``lr`` from the
                                                  optimizer) into ``wandb.run`` when one is
                                                  open; a console summary every 10 epochs
                                                  and at the last
PrunerCallback             on_val_end             ``trial.report(val_loss, epoch)``; raises
                                                  ``optuna.TrialPruned``
EarlyStoppingCallback      on_val_end             ``should_stop`` after ``patience`` epochs
CheckpointCallback         on_epoch_end           saves to ``checkpoint_dir``
=========================  =====================  =========================================
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.callbacks.checkpoint_policy import CheckpointPolicy
from hookloop.callbacks.early_stopping import EarlyStopping
from hookloop.callbacks.grad_monitor import GradientMonitor, GradientNormWarning
from hookloop.callbacks.loss_prediction import LossPrediction, prediction_score
from hookloop.callbacks.monitor import as_float
from hookloop.callbacks.nan_detection import REASON_PREFIX as NAN_PREFIX
from hookloop.callbacks.nan_detection import NaNDetection
from hookloop.callbacks.optimizer_mode import OptimizerMode, has_modes
from hookloop.callbacks.optuna_pruning import REASON_PREFIX as PRUNE_PREFIX
from hookloop.callbacks.optuna_pruning import OptunaPruning
from hookloop.callbacks.overfit import OverfitDetection, OverfitWarning, gap_ratio
from hookloop.callbacks.wandb_logger import WandbLoggingCallback
from hookloop.compat._toolkit import is_stateful
from hookloop.compat.hpo.callback import TrainingCallback

#: The W&B logger's console summary comes every this many epochs (epochs 0, 10, 20 …).
SUMMARY_EVERY = 10


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    return as_float(value)


def _store(trainer: Any, name: str, value: Any) -> None:
    """The HPO trainer's convention: results live on the trainer as ``trainer._<name>``.

    ``trainer`` (here and in every face) is the hand-written loop's own trainer object,
    which its hooks receive and read by the HPO trainer's convention, not hookloop's Trainer.
    """
    if trainer is not None:
        setattr(trainer, name, value)


class Face(TrainingCallback):
    """HPO-trainer hooks over one native built-in (``native``); same priority."""

    def __init__(self, native: Callback, peers: Sequence[Any] = ()) -> None:
        self.native = native
        self.priority = native.priority
        self.peers = peers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.native!r})"


class NaNFace(Face):
    native: NaNDetection

    def on_epoch_end(
        self,
        trainer: Any,
        epoch: int = 0,
        train_loss: Any = None,
        val_loss: Any = None,
        metrics: Any = None,
        **fields: Any,
    ) -> None:
        for name, raw in (("train_loss", train_loss), ("val_loss", val_loss)):
            value = _number(raw)
            if value is not None and math.isnan(value):
                self.native.nan_detected = True
                self.native.reason = f"{NAN_PREFIX} {name} is nan at epoch {epoch}"
                return


class OptimizerModeFace(Face):
    native: OptimizerMode

    def _switch(self, trainer: Any, mode: str) -> None:
        optimizer = getattr(trainer, "optimizer", None)
        if has_modes(optimizer, getattr(trainer, "model", None)):
            getattr(optimizer, mode)()

    def on_train_epoch_begin(self, trainer: Any, epoch: int = 0, **fields: Any) -> None:
        self._switch(trainer, "train")

    def on_val_begin(self, trainer: Any, epoch: int = 0, **fields: Any) -> None:
        self._switch(trainer, "eval")


class GradientMonitorFace(Face):
    """The HPO trainer's numbers: each parameter's gradient norm (in the gradient's dtype),
    summed in float64 as the HPO trainer does, so a norm past float32's range stays
    finite and an infinite one stays ``inf``; the epoch's maximum starts at 0.0 and a
    NaN norm never replaces it (Python's ``max``)."""

    native: GradientMonitor

    def __init__(self, native: Callback, peers: Sequence[Any] = ()) -> None:
        super().__init__(native, peers)
        self.epoch_max = 0.0

    def on_train_epoch_begin(self, trainer: Any, epoch: int = 0, **fields: Any) -> None:
        self.epoch_max = 0.0

    def on_train_step_end(
        self, trainer: Any, batch_idx: Any = None, loss: Any = None, **fields: Any
    ) -> None:
        model = getattr(trainer, "model", None)
        if model is None:
            return
        value = hpo_grad_norm([p.grad for p in model.parameters() if p.grad is not None])
        if value > self.native.warn_threshold:
            warnings.warn(
                f"GradientMonitor: gradient norm {value:.4g} exceeds warn_threshold "
                f"{self.native.warn_threshold:g} at batch {batch_idx}",
                GradientNormWarning,
                stacklevel=2,
            )
        self.epoch_max = max(self.epoch_max, value)

    def on_epoch_end(self, trainer: Any, *args: Any, **fields: Any) -> None:
        self.native.epoch_maxima.append(self.epoch_max)
        _store(trainer, "_max_grad_norm", self.epoch_max)


def hpo_grad_norm(grads: Sequence[torch.Tensor]) -> float:
    """The HPO trainer's total gradient norm: per-tensor norms, combined in float64.

    >>> big = 2.0**64  # its square is past float32's range
    >>> hpo_grad_norm([torch.tensor([3 * big]), torch.tensor([4 * big])]) == 5 * big
    True
    >>> hpo_grad_norm([torch.tensor([float("inf")]), torch.tensor([1.0])])
    inf
    """
    if not grads:
        return 0.0
    norms = torch.stack([g.detach().norm().double() for g in grads]).tolist()  # one read
    total = 0.0
    for norm in norms:
        total += norm**2
    return total**0.5


class LossPredictionFace(Face):
    """The HPO trainer's prediction: from epoch ``min_points`` (10) on, a least-squares line
    through ``log(val_loss)`` against the evaluation's index (0, 1, 2 ...), read at
    ``t = max_epochs``; None before."""

    native: LossPrediction

    def on_val_end(
        self,
        trainer: Any,
        epoch: int = 0,
        val_loss: Any = None,
        metrics: Any = None,
        **fields: Any,
    ) -> None:
        value = _number(val_loss)
        if value is None:
            return
        native = self.native
        native.times.append(float(len(native.losses)))
        native.losses.append(value)
        if epoch < native.min_points:
            _store(trainer, "_loss_prediction", None)
            return
        native.prediction = prediction_score(native.times, native.losses, native.max_epochs)
        _store(trainer, "_loss_prediction", native.prediction)


def hpo_diverging(train_losses: Sequence[float], val_losses: Sequence[float], window: int) -> bool:
    """The HPO trainer's test over the last ``window`` epochs (``window`` values): the train
    loss never rises and the validation loss never falls from one epoch to the next.

    >>> hpo_diverging([3, 2, 2, 1, 0.5], [1, 2, 2, 3, 4], window=5)  # flat steps count
    True
    >>> hpo_diverging([3, 2, 1, 0.5, 0.4], [1, 2, 3, 2, 4], window=5)
    False
    """
    train, val = train_losses[-window:], val_losses[-window:]
    return all(a >= b for a, b in pairwise(train)) and all(a <= b for a, b in pairwise(val))


class OverfitFace(Face):
    """The HPO trainer's overfitting check: from epoch ``warmup_epochs`` on, once
    ``window_size`` epochs are in, over the last ``window_size`` values."""

    native: OverfitDetection

    def on_epoch_end(
        self,
        trainer: Any,
        epoch: int = 0,
        train_loss: Any = None,
        val_loss: Any = None,
        metrics: Any = None,
        **fields: Any,
    ) -> None:
        train, val = _number(train_loss), _number(val_loss)
        if train is None or val is None:
            return
        native = self.native
        native.train_history.append(train)
        native.eval_history.append(val)
        window = native.window_size
        if (
            epoch >= native.warmup_epochs
            and len(native.train_history) >= window
            and hpo_diverging(native.train_history, native.eval_history, window)
        ):
            native.gap_ratio = gap_ratio(train, val)
            warnings.warn(
                f"OverfitDetection: over the last {window} epoch(s) to epoch {epoch} "
                f"train_loss did not rise while val_loss did not fall; gap ratio "
                f"val_loss/train_loss = {native.gap_ratio:.3f}",
                OverfitWarning,
                stacklevel=2,
            )
        else:
            native.gap_ratio = None
        _store(trainer, "_overfit_gap_ratio", native.gap_ratio)


class WandbFace(Face):
    """One ``wandb.log`` row per epoch with the HPO trainer's keys, and a console summary
    at epochs 0, 10, 20 ... and at the last one.

    Rows go to the W&B run already open in this process (``wandb.run``, the one you
    opened with ``wandb.init``), which stays yours to finish; without one, the
    callback opens a run with its own settings and finishes it at ``on_train_end``.
    ``lr`` is read from ``trainer.optimizer`` (its first parameter group), as the
    HPO trainer does; a loop without an optimizer may pass ``lr=`` itself.
    """

    native: WandbLoggingCallback
    #: trainer attribute -> W&B key, as the HPO trainer names them.
    PRODUCED = (
        ("_max_grad_norm", "max_grad_norm"),
        ("_overfit_gap_ratio", "overfit_gap_ratio"),
        ("_loss_prediction", "predicted_final_loss"),
    )

    def __init__(self, native: Callback, peers: Sequence[Any] = ()) -> None:
        super().__init__(native, peers)
        self.owns_run = False

    def on_train_begin(self, trainer: Any, **fields: Any) -> None:
        self._start(trainer)

    def _start(self, trainer: Any) -> None:
        native = self.native
        if native.run is not None:
            return
        import os

        from hookloop.callbacks.wandb_logger import import_wandb

        wandb = import_wandb()
        if wandb.run is not None:  # the user's own run: log there, leave finishing to them
            native.run, self.owns_run = wandb.run, False
            return
        kwargs: dict[str, Any] = {
            "project": native.project,
            "name": native.run_name,
            "entity": native.entity,
            "group": native.group,
            "tags": native.tags,
            "mode": native.mode or os.environ.get("WANDB_MODE") or "offline",
            "reinit": "create_new",
        }
        if native.dir is not None:
            Path(native.dir).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(native.dir)
        kwargs.update(native.init_kwargs)
        native.run = wandb.init(**{k: v for k, v in kwargs.items() if v is not None})
        self.owns_run = True

    def on_epoch_end(
        self,
        trainer: Any,
        epoch: int = 0,
        train_loss: Any = None,
        val_loss: Any = None,
        metrics: Any = None,
        **fields: Any,
    ) -> None:
        self._start(trainer)
        row: dict[str, Any] = {
            "train_loss": _number(train_loss),
            "val_loss": _number(val_loss),
            "lr": _learning_rate(trainer, fields.get("lr")),
        }
        for key, value in (metrics or {}).items():
            number = _number(value)
            if number is not None and key not in row:
                row[key] = number
        for attr, key in self.PRODUCED:
            if hasattr(trainer, attr) and getattr(trainer, attr) is not None:
                row[key] = getattr(trainer, attr)
        self.native.run.log(row)
        total = getattr(trainer, "_total_epochs", None)
        if epoch % SUMMARY_EVERY == 0 or (isinstance(total, int) and epoch == total - 1):
            from tqdm import tqdm

            shown = ", ".join(
                f"{k} {v:.4e}" for k, v in row.items() if isinstance(v, float) and k != "lr"
            )
            tqdm.write(
                f"epoch {epoch}: {shown}, lr {row['lr']:.2e}"
                if row["lr"] is not None
                else f"epoch {epoch}: {shown}"
            )

    def on_train_end(self, trainer: Any, **fields: Any) -> None:
        run, self.native.run = self.native.run, None
        if run is not None and self.owns_run:
            run.finish()
        self.owns_run = False


def _learning_rate(trainer: Any, given: Any) -> float | None:
    """``trainer.optimizer.param_groups[0]["lr"]``, else the ``lr`` field a loop passed."""
    groups = getattr(getattr(trainer, "optimizer", None), "param_groups", None)
    if groups:
        lr = _number(groups[0].get("lr"))
        if lr is not None:
            return lr
    return _number(given)


class PrunerFace(Face):
    native: OptunaPruning

    def on_val_end(
        self,
        trainer: Any,
        epoch: int = 0,
        val_loss: Any = None,
        metrics: Any = None,
        **fields: Any,
    ) -> None:
        native = self.native
        if getattr(native, "pruner_form", False):  # PrunerCallback(pruner, trial, seed)
            native.report_to_pruner(epoch, val_loss)
            return
        metrics = metrics or {}
        value = _number(
            val_loss if native.monitor in ("eval_loss", "val_loss") else metrics.get(native.monitor)
        )
        if value is None:
            return
        native.evaluations += 1
        native.trial.report(value, epoch)
        if native.trial.should_prune():
            import optuna

            native.pruned = True
            raise optuna.TrialPruned(
                f"{PRUNE_PREFIX} trial {native.trial.number} pruned at epoch {epoch} "
                f"(val_loss={value:.6g})"
            )


class EarlyStoppingFace(Face):
    native: EarlyStopping

    def on_val_end(
        self,
        trainer: Any,
        epoch: int = 0,
        val_loss: Any = None,
        metrics: Any = None,
        **fields: Any,
    ) -> None:
        native = self.native
        monitor = native.monitor
        metrics = metrics or {}
        raw = (
            val_loss
            if monitor == "eval_loss"
            else metrics.get(getattr(native, "hpo_monitor", monitor), metrics.get(monitor))
        )
        value = _number(raw)
        if value is None:
            return
        tracker = native.trackers[monitor]
        if tracker.update(value):
            native.best_steps[monitor] = epoch
        if tracker.bad_count >= native.patience and not native.should_stop:
            native.should_stop = True
            native.stopped_step = epoch


class CheckpointFace(Face):
    """Saves model, optimizer, scheduler and the stateful callbacks to ``checkpoint_dir``,
    or hands them to the HPO trainer's checkpoint manager (``CheckpointCallback(manager,
    config_hash)``), with the early-stopping state of ``trainer.callbacks``."""

    native: CheckpointPolicy

    def on_train_begin(self, trainer: Any, **fields: Any) -> None:
        if getattr(self.native, "checkpoint_manager", None) is None:
            self._callback().directory_manager()

    def _callback(self) -> Any:
        """The HPO trainer's CheckpointCallback (it alone saves by itself, ``save_epoch``)."""
        if not callable(getattr(self.native, "save_epoch", None)):
            raise ValueError(
                f"{type(self.native).__name__} saves only inside a hookloop Trainer; in a loop "
                "driven by CallbackRunner.fire use CheckpointCallback(checkpoint_dir=...)"
            )
        return self.native

    def on_epoch_end(
        self,
        trainer: Any,
        epoch: int = 0,
        train_loss: Any = None,
        val_loss: Any = None,
        metrics: Any = None,
        **fields: Any,
    ) -> None:
        from hookloop.checkpoint import CallbackStates

        native = self._callback()
        if native.checkpoint_manager is not None:
            runner = getattr(trainer, "callbacks", None)
            peers = getattr(runner, "callbacks", None) or self.peers
            native.manager_save(trainer, epoch, val_loss, metrics, peers)
            return
        state: dict[str, Any] = {"model": trainer.model, "optimizer": trainer.optimizer}
        scheduler = getattr(trainer, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "state_dict"):
            state["scheduler"] = scheduler
        stateful = {
            getattr(cb, "name", type(cb).__name__): cb
            for cb in self.peers
            if cb is not native and is_stateful(cb)
        }
        if stateful:
            state["callbacks"] = CallbackStates(stateful)
        native.save_epoch(state, epoch, _number(val_loss))


_FACES: tuple[tuple[type, type[Face]], ...] = (
    (NaNDetection, NaNFace),
    (OptimizerMode, OptimizerModeFace),
    (GradientMonitor, GradientMonitorFace),
    (LossPrediction, LossPredictionFace),
    (OverfitDetection, OverfitFace),
    (WandbLoggingCallback, WandbFace),
    (OptunaPruning, PrunerFace),
    (EarlyStopping, EarlyStoppingFace),
    (CheckpointPolicy, CheckpointFace),
)


def face_for(callback: Callback, peers: Sequence[Any] = ()) -> Face | None:
    """The HPO-trainer face of one of the nine built-ins; None for any other native callback."""
    for native_type, face in _FACES:
        if isinstance(callback, native_type):
            return face(callback, peers)
    return None
