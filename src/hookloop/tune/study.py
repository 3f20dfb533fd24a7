"""A study on disk: its spec (``tune.yaml``), its Optuna storage, and the trial loop.

A study directory holds ``tune.yaml`` (what the command asked for), the Optuna
storage ``study.db`` (SQLite, unless ``--storage`` names another), one run
directory per trial (``trial-0007/``, a normal hookloop run with its
``config.yaml`` and a ``params.yaml``), and at the end ``best_config.yaml``,
``best_trials.txt`` and ``plots/``.

This module gathers the study's names in one place; each lives in the module of its
concern, read in this order:

- :mod:`hookloop.tune.spec`: what a study is (:class:`TuneSpec`, its directory's files,
  the sampler and pruner it names);
- :mod:`hookloop.tune.storage`: opening it on its Optuna storage;
- :mod:`hookloop.tune.claims`: how drivers share its trials (the claim lock, recovering
  a dead process's trials, heartbeats across machines);
- :mod:`hookloop.tune.interrupts`: SIGINT and SIGTERM while it runs;
- :mod:`hookloop.tune.trial`: one trial's life, from training to COMPLETE, PRUNED or FAIL;
- :mod:`hookloop.tune.driver`: the loop that claims trials and runs them (:func:`work`).
"""

from __future__ import annotations

from hookloop.tune.claims import (
    HOST_ENV,
    UNCLAIMED_AFTER_S,
    Counts,
    beat_once,
    counts,
    driver_salt,
    heartbeat,
    host_name,
    recover_interrupted,
    requeue,
    study_lock,
    surplus,
)
from hookloop.tune.driver import finished_elsewhere, follow, work
from hookloop.tune.interrupts import Interrupts, StudyInterrupted
from hookloop.tune.spec import (
    BEST_CONFIG_FILE,
    CONSOLE_LOG,
    CONSTRAINED_SAMPLERS,
    CONSTRAINT_ATTR,
    DB_FILE,
    DIRECTIONS,
    IDENTITY,
    LOCK_FILE,
    MULTI_OBJECTIVE_SAMPLERS,
    PARAM_COUNT,
    PRUNERS,
    SAMPLERS,
    SPEC_FILE,
    Constraint,
    TuneError,
    TuneSpec,
    check_objectives,
    constraint_values,
    feasible,
    is_study_dir,
    make_pruner,
    make_sampler,
    optuna,
    trial_dir,
    trials_set_constraints,
)
from hookloop.tune.storage import open_study, open_study_on_storage
from hookloop.tune.trial import (
    HELD_SIGNAL,
    BestMetric,
    HeldSignal,
    fail,
    interrupted,
    record_constraints,
    run_trial,
    take_over_run_dir,
    tee_output,
    train_trial,
)

__all__ = [
    "BEST_CONFIG_FILE",
    "CONSOLE_LOG",
    "CONSTRAINED_SAMPLERS",
    "CONSTRAINT_ATTR",
    "DB_FILE",
    "DIRECTIONS",
    "HELD_SIGNAL",
    "HOST_ENV",
    "IDENTITY",
    "LOCK_FILE",
    "MULTI_OBJECTIVE_SAMPLERS",
    "PARAM_COUNT",
    "PRUNERS",
    "SAMPLERS",
    "SPEC_FILE",
    "UNCLAIMED_AFTER_S",
    "BestMetric",
    "Constraint",
    "Counts",
    "HeldSignal",
    "Interrupts",
    "StudyInterrupted",
    "TuneError",
    "TuneSpec",
    "beat_once",
    "check_objectives",
    "constraint_values",
    "counts",
    "driver_salt",
    "fail",
    "feasible",
    "finished_elsewhere",
    "follow",
    "heartbeat",
    "host_name",
    "interrupted",
    "is_study_dir",
    "make_pruner",
    "make_sampler",
    "open_study",
    "open_study_on_storage",
    "optuna",
    "record_constraints",
    "recover_interrupted",
    "requeue",
    "run_trial",
    "study_lock",
    "surplus",
    "take_over_run_dir",
    "tee_output",
    "train_trial",
    "trial_dir",
    "trials_set_constraints",
    "work",
]
