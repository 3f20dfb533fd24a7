"""The errors hookloop raises when it refuses what it was asked to do.

The ``hookloop`` command tells two kinds of failure apart by type. A
:class:`ConfigError` is hookloop's own validation of the command line, the
config, a recipe name, a run directory or a resume path: it is shown as one line
and the command exits 2. Anything else that escapes a run (the model, the loss,
the data, a callback, a recipe: the user's own code) keeps its traceback and
exits 1.

``ConfigError`` subclasses ``ValueError``, so ``except ValueError`` keeps working::

    >>> issubclass(ConfigError, ValueError)
    True

This module imports nothing, so the command line can use it without loading torch.
"""

from __future__ import annotations

__all__ = ["ConfigError", "MissingExtraError"]


class ConfigError(ValueError):
    """A bad command line, config key or value, recipe name, run directory or resume
    path: the message names what was wrong and what is allowed."""


class MissingExtraError(ImportError):
    """An optional integration whose package is not installed; the message names the
    extra to install (``pip install 'hookloop[tensorboard]'``)."""
