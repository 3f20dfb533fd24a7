"""The HPO trainer's callback dialect: ``TrainingCallback`` hooks that take ``(trainer, **fields)``.

Code written for the HPO trainer runs with its import line changed to this package.
A runner fires the seven events (:data:`EVENTS`) at callbacks in priority order,
in a loop you write yourself:

>>> class PrintVal(TrainingCallback):
...     def on_val_end(self, trainer, epoch, val_loss, **kwargs):
...         print(f"epoch {epoch}: val_loss {val_loss}")
>>> runner = CallbackRunner([PrintVal()])
>>> runner.fire("on_val_end", trainer=None, epoch=0, val_loss=0.25, metrics={})
epoch 0: val_loss 0.25

or inside a hookloop Trainer, next to native callbacks:
``Trainer(..., callbacks=runner.native())``. There each HPO-trainer callback becomes
an :class:`HpoAdapter` with the same priority; its hooks get an
:class:`HpoTrainer` (the HPO trainer's ``trainer._<name>`` attributes, served from
``ctx.user_state``) and the fields in :data:`FIELDS`. The nine HPO-trainer built-ins
are native hookloop callbacks under the HPO trainer's names, importable here (and
only here); a runner passes them through to the Trainer unchanged, and ``fire``
drives them in your own loop through their HPO-trainer faces
(:mod:`hookloop.compat.hpo.faces`), as the HPO trainer does. Their seven hooks can
also be called directly, with the HPO trainer's arguments (:mod:`hookloop.compat.hpo.direct`).
They take the HPO trainer's constructors: ``PrunerCallback(pruner, trial, seed)``,
``CheckpointCallback(checkpoint_manager, config_hash)``, and hookloop's forms beside them
(relative ``min_delta``, ``early_stopping_config``, ``save_every_n_epochs``,
``keep_last_k``; :mod:`hookloop.compat.hpo.builtins`).
"""

from hookloop.compat.hpo.adapter import FIELDS, HpoAdapter, adapt
from hookloop.compat.hpo.builtins import (
    CheckpointCallback,
    EarlyStoppingCallback,
    EarlyStoppingConfig,
    early_stopping_from_config,
)
from hookloop.compat.hpo.callback import EVENTS, TrainingCallback
from hookloop.compat.hpo.direct import (
    GradientMonitorCallback,
    HpoHooks,
    LossPredictionCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
    OverfitDetectionCallback,
    PrunerCallback,
    WandbLoggingCallback,
)
from hookloop.compat.hpo.runner import CallbackRunner, as_native
from hookloop.compat.hpo.trainer_view import CONVENTION, HpoTrainer

__all__ = [
    "CONVENTION",
    "EVENTS",
    "FIELDS",
    "CallbackRunner",
    "CheckpointCallback",
    "EarlyStoppingCallback",
    "EarlyStoppingConfig",
    "GradientMonitorCallback",
    "HpoAdapter",
    "HpoHooks",
    "HpoTrainer",
    "LossPredictionCallback",
    "NaNDetectionCallback",
    "OptimizerModeCallback",
    "OverfitDetectionCallback",
    "PrunerCallback",
    "TrainingCallback",
    "WandbLoggingCallback",
    "adapt",
    "as_native",
    "early_stopping_from_config",
]
