"""``hookloop.tune.study`` names the whole study: what it is (``spec``), its storage, how
drivers share its trials (``claims``), signals (``interrupts``), a trial's life (``trial``)
and the driver loop (``driver``). Each name lives in one of those modules and is still
importable from ``hookloop.tune.study`` (and the package's from ``hookloop.tune``)."""

from __future__ import annotations

import importlib

import hookloop.tune
import hookloop.tune.study as study

#: What ``from hookloop.tune.study import ...`` offered when it was one module.
STUDY_NAMES = {
    "BEST_CONFIG_FILE", "CONSOLE_LOG", "CONSTRAINED_SAMPLERS", "CONSTRAINT_ATTR", "DB_FILE",
    "DIRECTIONS", "HELD_SIGNAL", "HOST_ENV", "IDENTITY", "LOCK_FILE",
    "MULTI_OBJECTIVE_SAMPLERS", "PARAM_COUNT", "PRUNERS", "SAMPLERS", "SPEC_FILE",
    "UNCLAIMED_AFTER_S", "BestMetric", "Constraint", "Counts", "HeldSignal", "Interrupts",
    "StudyInterrupted", "TuneError", "TuneSpec", "beat_once", "check_objectives",
    "constraint_values", "counts", "driver_salt", "fail", "feasible", "finished_elsewhere",
    "follow", "heartbeat", "host_name", "interrupted", "is_study_dir", "make_pruner",
    "make_sampler", "open_study", "open_study_on_storage", "optuna", "record_constraints",
    "recover_interrupted", "requeue", "run_trial", "study_lock", "surplus",
    "take_over_run_dir", "tee_output", "train_trial", "trial_dir", "trials_set_constraints",
    "work",
}  # fmt: skip

HOMES = ("spec", "storage", "claims", "interrupts", "trial", "driver")


def test_every_name_of_the_study_still_imports_from_hookloop_tune_study():
    assert set(study.__all__) == STUDY_NAMES
    homes = [importlib.import_module(f"hookloop.tune.{name}") for name in HOMES]
    for name in STUDY_NAMES:
        defined_in = [home.__name__ for home in homes if name in vars(home)]
        assert defined_in, f"{name} lives in none of {HOMES}"
        home = importlib.import_module(defined_in[0])
        assert getattr(study, name) is getattr(home, name), name


def test_the_package_exports_the_same_objects_as_the_modules():
    for name in ("TuneError", "TuneSpec", "is_study_dir", "open_study", "work"):
        assert getattr(hookloop.tune, name) is getattr(study, name), name
    assert hookloop.tune.work.__module__ == "hookloop.tune.driver"
    assert hookloop.tune.TuneSpec.__module__ == "hookloop.tune.spec"
