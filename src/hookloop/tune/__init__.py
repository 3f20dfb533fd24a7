"""``hookloop tune``: hyper-parameter search over any config key, on Optuna.

A study is a directory: ``tune.yaml`` (the command), the Optuna storage
(``study.db``, a real SQLite file, unless ``--storage`` names another), one
ordinary run directory per trial, and at the end ``best_trials.txt``,
``best_config.yaml`` and ``plots/``. See :mod:`hookloop.tune.space` for the
search-space format, :mod:`hookloop.tune.study` for the modules that say how trials
are claimed, scored and recovered after a kill, and :func:`run` for the Python API.
"""

from hookloop.tune.api import run
from hookloop.tune.driver import work
from hookloop.tune.space import SearchSpace, apply_params
from hookloop.tune.spec import TuneError, TuneSpec, is_study_dir
from hookloop.tune.storage import open_study

__all__ = [
    "SearchSpace",
    "TuneError",
    "TuneSpec",
    "apply_params",
    "is_study_dir",
    "open_study",
    "run",
    "work",
]
