"""Lazy imports of optional backends, with an error that says what to install.

The core never imports TensorBoard, wandb or matplotlib. The integrations call
:func:`require` when they are first used, so a missing package costs nothing
until someone asks for that backend, and then the error names the extra::

    >>> require("json", extra="none").__name__
    'json'
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hookloop.errors import MissingExtraError


def require(module: str, *, extra: str, feature: str | None = None) -> ModuleType:
    """Import ``module`` or raise :class:`~hookloop.errors.MissingExtraError` (an ImportError)
    naming ``pip install hookloop[extra]``.

    ``feature`` names what needed it (e.g. ``"TBLogger"``) in the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".", 1)[0]
        who = f"{feature} needs" if feature else "this feature needs"
        raise MissingExtraError(
            f"{who} the optional package {top!r}, which could not be imported ({err}). "
            f"Install it with: pip install 'hookloop[{extra}]'"
        ) from err
