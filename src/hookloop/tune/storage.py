"""The study on its Optuna storage: SQLite in the study directory, or what ``--storage``
names (a database URL, ``journal:FILE``, ``redis://``).

Opening is retried when drivers starting together race to create one fresh database,
and any other failure is one ``ValueError`` naming the storage with its password masked.
On an RDB storage with a heartbeat, a trial whose machine went silent is failed by any
driver and retried (:func:`hookloop.tune.claims.requeue`).

SQLite serialises writers with file locks: a connection waits up to
:data:`SQLITE_BUSY_SECONDS` for one, and may be told "database is locked" at once where
waiting could deadlock. hookloop's own records of a trial (who claims it, why it was cut)
go through :func:`retry_locked`, so a busy machine delays them instead of killing the
worker that writes them.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hookloop.tune import credentials
from hookloop.tune.claims import requeue
from hookloop.tune.spec import DB_FILE, SPEC_FILE, TuneSpec, make_pruner, make_sampler, optuna


def open_study(
    spec: TuneSpec, study_dir: Path, *, sampler_seed: int | None = None, existing: bool = False
) -> Any:
    """Create or load the study on its storage (SQLite in the study directory by default);
    with ``existing``, only load it (which Optuna does without a log line).

    A storage that cannot be opened (an unknown URL scheme, a damaged ``study.db``) raises
    ``ValueError`` naming it, for the command to report in one line.
    """
    study, _ = open_study_on_storage(spec, study_dir, sampler_seed=sampler_seed, existing=existing)
    return study


def open_study_on_storage(
    spec: TuneSpec, study_dir: Path, *, sampler_seed: int | None = None, existing: bool = False
) -> tuple[Any, Any]:
    """:func:`open_study`, and the Optuna storage it opened the study on.

    The driver keeps the storage to recover, fail and beat for trials by id
    (:mod:`hookloop.tune.claims`): Optuna's ``Study`` has no public
    getter for its storage, so the one hookloop made is handed along instead.
    """
    opt = optuna()
    seed = spec.seed if sampler_seed is None else sampler_seed
    shown = credentials.mask(spec.storage)
    if credentials.is_masked(spec.storage):
        raise ValueError(
            f"the password of --storage {shown} is not kept in {study_dir / SPEC_FILE}: give "
            f"--storage with it again, or set ${credentials.STORAGE_ENV} to the whole URL"
        )
    for attempt in range(4):  # drivers starting together on a fresh database race to create it
        try:
            storage = _optuna_storage(spec, study_dir)
            found = {
                "storage": storage,
                "study_name": spec.study_name,
                "sampler": make_sampler(spec, seed),
                "pruner": make_pruner(spec.pruner, spec.pruner_args),
            }
            if existing:
                return opt.load_study(**found), storage
            study = opt.create_study(**found, directions=spec.directions, load_if_exists=True)
            return study, storage
        except ValueError:
            raise
        except Exception as err:  # SQLAlchemy's and Optuna's errors share no base worth naming
            if attempt < 3 and type(err).__name__ in _RACES:
                time.sleep(0.2 + 0.3 * random.random() * (attempt + 1))
                continue
            where = study_dir / DB_FILE if spec.storage is None else f"--storage {shown}"
            text = credentials.scrub(str(err), spec.storage)
            reason = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
            raise ValueError(
                f"cannot open the study's storage {where} ({type(err).__name__}: "
                f"{reason[:200]}); give a storage URL Optuna accepts (sqlite:///FILE, "
                "postgresql://..., mysql://..., journal:FILE, redis://...) or restore the "
                "database"
            ) from None
    raise AssertionError("unreachable")


#: How long a SQLite connection waits for another's lock before "database is locked".
SQLITE_BUSY_SECONDS = 60.0
#: How long :func:`retry_locked` goes on trying one write.
LOCKED_PATIENCE_SECONDS = 300.0
T = TypeVar("T")


def retry_locked(write: Callable[[], T]) -> T:
    """``write()``, tried again while the storage says its database is locked (SQLite under
    load), for up to :data:`LOCKED_PATIENCE_SECONDS`. Each ``write`` must be one storage
    call (a transaction that failed changed nothing). Any other error passes through."""
    deadline, pause = time.monotonic() + LOCKED_PATIENCE_SECONDS, 0.05
    while True:
        try:
            return write()
        except Exception as err:
            if not _locked(err) or time.monotonic() > deadline:
                raise
        time.sleep(pause * (1 + random.random()))
        pause = min(pause * 2, 2.0)


def _locked(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) is SQLite's "database is locked"."""
    seen = 0
    while err is not None and seen < 8:
        if "database is locked" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


#: Errors of drivers creating one fresh database's schema or study at once (retried).
_RACES = ("IntegrityError", "OperationalError", "ProgrammingError", "DuplicatedStudyError")


def _optuna_storage(spec: TuneSpec, study_dir: Path) -> Any:
    """The Optuna storage ``--storage`` names: an RDB URL (with Optuna's heartbeat when
    :meth:`TuneSpec.heartbeat_seconds` says), ``journal:FILE`` or ``redis://``
    (``JournalStorage``, which has no heartbeat)."""
    opt = optuna()
    url = spec.storage_url(study_dir)
    if url.startswith("journal:"):
        path = url[len("journal:") :].removeprefix("//")
        if not path:
            raise ValueError("--storage journal:FILE needs a file, e.g. journal:study.log")
        return opt.storages.JournalStorage(opt.storages.journal.JournalFileBackend(path))
    if url.startswith(("redis://", "rediss://")):
        return opt.storages.JournalStorage(opt.storages.journal.JournalRedisBackend(url))
    sqlite = url.startswith("sqlite")
    engine_kwargs = {"connect_args": {"timeout": SQLITE_BUSY_SECONDS}} if sqlite else None
    beat = spec.heartbeat_seconds()
    with warnings.catch_warnings():  # Optuna marks its heartbeat experimental
        warnings.simplefilter("ignore", opt.exceptions.ExperimentalWarning)
        return opt.storages.RDBStorage(
            url,
            engine_kwargs=engine_kwargs,
            heartbeat_interval=beat,
            grace_period=2 * beat if beat else None,
            heartbeat_stale_trial_callback=_retry_stale if beat else None,
        )


def _retry_stale(study: Any, trial: Any) -> None:
    """Optuna failed ``trial`` for a lost heartbeat (its machine or process is gone): retry
    it. Called once, by the driver whose ``fail_stale_trials`` failed it."""
    requeue(study, trial, reason=f"no heartbeat from {trial.user_attrs.get('host')}")
