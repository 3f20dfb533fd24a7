"""How a failed ``hookloop`` command is reported: one line or a traceback, and its exit code.

Told apart by type, never by guessing from the message:

- hookloop refusing what it was asked (:class:`~hookloop.errors.ConfigError`, a missing
  optional package, a run directory another process trains into): one line, exit code 2;
- what the machine could not do (a full disk, a read-only file system, out of memory, a
  log write that failed for one of these): one line, exit code 1;
- anything else, the user's own code failing (the model, the loss, the data, a callback, a
  recipe) or a bug: the traceback, exit code 1.

``hookloop tune`` and ``hookloop diloco`` still refuse with plain ``ValueError`` and
``OSError``; what their own modules raise (:data:`UNTYPED_REFUSALS`) is reported as
before, in one line, until they raise ``ConfigError``.
"""

from __future__ import annotations

import errno
import sys

from hookloop.errors import ConfigError, MissingExtraError
from hookloop.result import ExitCode

#: Packages whose own refusals are still plain ValueError/OSError/ImportError.
UNTYPED_REFUSALS = ("hookloop.tune", "hookloop.diloco")

#: OSErrors that are the machine's, not the code's: a full disk or quota, a read-only or
#: lost file system, no memory.
MACHINE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ESTALE, errno.ENOMEM}
)


def error_line(err: Exception) -> tuple[str | None, int]:
    """The one line and exit code for ``err``, or ``(None, 1)`` for a traceback: hookloop's
    refusals are exit 2, what the machine could not do exit 1, anything else a traceback."""
    if is_refusal(err):
        return one_line(err), ExitCode.USAGE
    if _raised_in(err, UNTYPED_REFUSALS):
        untyped = (ValueError, ImportError, FileNotFoundError, NotADirectoryError)
        untyped += (IsADirectoryError, PermissionError)
        if isinstance(err, untyped):
            return one_line(err), ExitCode.USAGE
        if isinstance(err, OSError):
            return one_line(err), ExitCode.ERROR
    return _machine_error(err), ExitCode.ERROR


def is_refusal(err: BaseException) -> bool:
    """Whether ``err`` is hookloop refusing what it was asked: a
    :class:`~hookloop.errors.ConfigError`, a missing optional package, or a run directory
    another process trains into."""
    if isinstance(err, (ConfigError, MissingExtraError)):
        return True
    runlock = sys.modules.get("hookloop.runlock")  # not imported: not what was raised
    return runlock is not None and isinstance(err, runlock.RunDirLocked)


def _raised_in(err: BaseException, packages: tuple[str, ...]) -> bool:
    """Whether the innermost Python frame of ``err``'s traceback is in one of ``packages``."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    return any(module == p or module.startswith(p + ".") for p in packages)


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
        text = f"{text}: {err.filename}"
    return text


def _machine_error(err: BaseException) -> str | None:
    """One line for what the machine could not do (exit 1), or None for a bug (a traceback).

    A log write that failed for an OSError (a full disk) reaches the loop as a
    ``LogWriterError``; a model or batch too large for memory as a ``MemoryError`` or
    torch's allocation error.
    """
    writer = sys.modules.get("hookloop.callbacks._writer")
    if (
        writer is not None
        and isinstance(err, writer.LogWriterError)
        and isinstance(err.__cause__, OSError)
    ):
        return (
            f"could not write the run's logs ({one_line(err.__cause__)}); the checkpoints "
            "already saved are intact: free space, then continue with --resume auto"
        )
    if isinstance(err, OSError) and err.errno in MACHINE_ERRNOS:
        return one_line(err)
    if not isinstance(err, (RuntimeError, MemoryError)):
        return None
    text = one_line(err)
    if isinstance(err, MemoryError) or "out of memory" in text or "can't allocate" in text:
        return (
            f"out of memory ({text[:300]}); choose a smaller model (model.*), batch "
            "(data.batch_size) or precision (train.precision)"
        )
    return None
