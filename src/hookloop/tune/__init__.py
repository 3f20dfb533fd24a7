"""``hookloop tune``: hyper-parameter search over any config key, on Optuna.

A study is a directory: ``tune.yaml`` (the command), the Optuna storage
(``study.db``, a real SQLite file, unless ``--storage`` names another), one
ordinary run directory per trial, and at the end ``best_trials.txt``,
``best_config.yaml`` and ``plots/``. See :mod:`hookloop.tune.space` for the
search-space format, :mod:`hookloop.tune.study` for the modules that say how trials
are claimed, scored and recovered after a kill, and :func:`run` for the Python API.

:func:`lr_find` is the learning-rate range test (``hookloop lr-find``), a sweep of one
short run rather than a study (:mod:`hookloop.tune.lr_find`).
"""

from hookloop.tune.api import run
from hookloop.tune.driver import work
from hookloop.tune.lr_find import LRFindResult, lr_find
from hookloop.tune.space import SearchSpace, apply_params
from hookloop.tune.spec import TuneError, TuneSpec, is_study_dir
from hookloop.tune.storage import open_study

__all__ = [
    "LRFindResult",
    "SearchSpace",
    "TuneError",
    "TuneSpec",
    "apply_params",
    "is_study_dir",
    "lr_find",
    "open_study",
    "run",
    "work",
]
