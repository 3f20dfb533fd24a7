"""Deprecated home of Forgather's ``DiLoCoCallback``: use :mod:`hookloop.compat.forgather`.

Kept for one release; importing it warns.
"""

from __future__ import annotations

import warnings

from hookloop.diloco.callback import DiLoCoCallback

__all__ = ["DiLoCoCallback"]

warnings.warn(
    "hookloop.compat.hf.seed004_diloco moved to hookloop.compat.forgather; the old path goes "
    "away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
