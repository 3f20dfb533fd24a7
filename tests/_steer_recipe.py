"""A recipe for the live-settings tests (not collected): mlp-regression, pausing
``$STEER_SLEEP`` seconds after each step so that a test can steer and kill it mid-run.

    hookloop train --recipe _steer_recipe:RECIPE ...   (run from the tests directory)
"""

from __future__ import annotations

import os
import time

from hookloop import Callback
from hookloop.recipes import Recipe, default_config, get_recipe


class _Pause(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_step_end(self, ctx) -> None:
        time.sleep(self.seconds)


def _config():
    cfg = default_config("mlp-regression")
    cfg.recipe = "_steer_recipe:RECIPE"
    return cfg


def _build(cfg):
    parts = get_recipe("mlp-regression").build(cfg)
    seconds = float(os.environ.get("STEER_SLEEP") or 0)
    if seconds > 0:
        parts.callbacks.append(_Pause(seconds))
    return parts


RECIPE = Recipe("steer", "mlp-regression that can pause after each step", _config, _build)
