"""Forgather's ``InfoCallback``: the run summary printed at train start."""

from __future__ import annotations

from hookloop.callbacks import info as _info
from hookloop.compat.forgather.callbacks.common import check_flag
from hookloop.compat.forgather.events import answers_transformers_events

__all__ = ["InfoCallback"]


@answers_transformers_events
class InfoCallback(_info.InfoCallback):
    """``InfoCallback(verbose=False)``: the run summary on stdout at train start (rank 0)."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__("stdout", verbose=check_flag("verbose", verbose))
