"""``hookloop tune``: hyper-parameter search over any config key, on Optuna.

A study is a directory: ``tune.yaml`` (the command), the Optuna storage
(``study.db``, a real SQLite file, unless ``--storage`` names another), one
ordinary run directory per trial, and at the end ``best_trials.txt``,
``best_config.yaml`` and ``plots/``. See :mod:`hookloop.tune.space` for the
search-space format, :mod:`hookloop.tune.study` for how trials are claimed,
scored and recovered after a kill, and :func:`run` for the Python API.
"""

from hookloop.tune.api import run
from hookloop.tune.space import SearchSpace, apply_params
from hookloop.tune.study import TuneError, TuneSpec, is_study_dir, open_study, work

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
