"""A study on disk: its spec (``tune.yaml``), its Optuna storage, and the trial loop.

A study directory holds ``tune.yaml`` (what the command asked for), the Optuna
storage ``study.db`` (SQLite, unless ``--storage`` names another), one run
directory per trial (``trial-0007/``, a normal hookloop run with its
``config.yaml`` and a ``params.yaml``), and at the end ``best_config.yaml``,
``best_trials.txt`` and ``plots/``.

Claiming a trial happens under a file lock (``.tune.lock``), so that K local
workers never start more than N trials between them. Under the same lock a
worker looks for RUNNING trials whose process is gone (a SIGKILLed driver takes
its workers with it): each is marked FAIL with the reason, and its parameters
are enqueued again (``study.enqueue_trial``), so a restart finishes exactly N
COMPLETE or PRUNED trials with none lost or run twice.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import fcntl
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hookloop._optional import require
from hookloop.callback import Callback
from hookloop.callbacks.monitor import as_float, check_metric_name
from hookloop.config import Config, dump_yaml
from hookloop.processes import process_alive
from hookloop.recipes import resolve_config
from hookloop.rundir import RunDir, is_checkpoints_folder
from hookloop.state import CallbackContext
from hookloop.tune import credentials
from hookloop.tune.space import SearchSpace, apply_params

SPEC_FILE = "tune.yaml"
DB_FILE = "study.db"
LOCK_FILE = ".tune.lock"
#: A RUNNING trial with no process recorded this long after it started lost its claimer.
UNCLAIMED_AFTER_S = 60
BEST_CONFIG_FILE = "best_config.yaml"
CONSOLE_LOG = "console.log"
DIRECTIONS = ("minimize", "maximize")
PRUNERS = ("median", "percentile", "hyperband", "successive-halving", "threshold", "none")
SAMPLERS = ("tpe", "random", "grid", "cmaes", "qmc", "gp", "nsga2")
#: Samplers that steer away from infeasible trials (``--constraint``).
CONSTRAINED_SAMPLERS = ("tpe", "gp", "nsga2")
#: Samplers that take several objectives (``--metric a,b``).
MULTI_OBJECTIVE_SAMPLERS = ("tpe", "random", "grid", "qmc", "gp", "nsga2")
#: A quantity hookloop measures on every trial (usable as a metric or in a constraint).
PARAM_COUNT = "param_count"
#: The user attribute holding a trial's constraint values (feasible when all are <= 0).
CONSTRAINT_ATTR = "constraint"
#: What a sampler needs beyond Optuna (checked before the study starts).
_SAMPLER_NEEDS = {"cmaes": ("cmaes",), "qmc": ("scipy",), "gp": ("scipy",)}
#: Fields of the spec that make a study what it is: a restart must repeat them.
IDENTITY = (
    "recipe", "overrides", "space", "metric", "direction", "pruner", "seed", "study_name",
    "sampler", "sampler_args", "pruner_args", "constraints",
)  # fmt: skip


#: Environment variable naming this machine in the study (default: the host name). Two
#: drivers on one machine with different values stand for two machines.
HOST_ENV = "HOOKLOOP_TUNE_HOST"


class TuneError(RuntimeError):
    """A study that cannot go on (too many failed trials, a changed command …)."""


class StudyInterrupted(BaseException):
    """SIGINT or SIGTERM stopped the study; the trial it cut is FAIL and queued again."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def host_name() -> str:
    """This machine's name in the study: ``$HOOKLOOP_TUNE_HOST``, else the host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def check_objectives(metric: Any, direction: Any) -> None:
    """Check ``--metric`` (one name or a list) and ``--direction`` (one, or one per metric)."""
    metrics = [metric] if isinstance(metric, str) else metric
    if not isinstance(metrics, list) or not metrics:
        raise ValueError(
            f"--metric must be a metric name or a list of them, such as eval_loss or "
            f"[eval_loss, param_count], got {metric!r}"
        )
    for name in metrics:
        check_metric_name(name, "--metric")
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"--metric names a metric twice: {', '.join(metrics)}")
    directions = [direction] if isinstance(direction, str) else direction
    if not isinstance(directions, list) or len(directions) not in (1, len(metrics)):
        raise ValueError(
            f"--direction must be one direction, or one per --metric ({len(metrics)}: "
            f"{', '.join(metrics)}), got {direction!r}"
        )
    for name in directions:
        if name not in DIRECTIONS:
            raise ValueError(f"--direction must be 'minimize' or 'maximize', got {name!r}")


@dataclass(frozen=True)
class Constraint:
    """``METRIC <= BOUND`` or ``METRIC >= BOUND``; Optuna's value is <= 0 when it holds."""

    text: str
    metric: str
    op: str
    bound: float

    _FORM = "write 'METRIC <= NUMBER' or 'METRIC >= NUMBER', e.g. 'param_count <= 2e6'"

    @classmethod
    def parse(cls, text: Any) -> Constraint:
        if not isinstance(text, str):
            raise ValueError(f"--constraint {text!r}: {cls._FORM}")
        for op in ("<=", ">="):
            left, found, right = text.partition(op)
            if found:
                break
        else:
            strict = " (< and > are not allowed)" if any(c in text for c in "<>=") else ""
            raise ValueError(f"--constraint {text!r}: {cls._FORM}{strict}")
        metric, bound_text = left.strip(), right.strip()
        if not re.fullmatch(r"[A-Za-z_][\w./-]*", metric):
            raise ValueError(f"--constraint {text!r}: {metric!r} is not a metric name; {cls._FORM}")
        try:
            bound = float(bound_text)
        except ValueError:
            raise ValueError(
                f"--constraint {text!r}: the bound {bound_text!r} is not a number; {cls._FORM}"
            ) from None
        if not math.isfinite(bound):
            raise ValueError(f"--constraint {text!r}: the bound must be finite; {cls._FORM}")
        return cls(text=text.strip(), metric=metric, op=op, bound=bound)

    def value(self, measured: float) -> float:
        """Optuna's constraint value: <= 0 when ``measured`` satisfies the bound."""
        return measured - self.bound if self.op == "<=" else self.bound - measured


class Interrupts:
    """SIGINT and SIGTERM stop the study (main thread only).

    A signal is held while the study's storage is being written (claiming or recording a
    trial) and raised as :class:`StudyInterrupted` at the next safe point: while waiting,
    or while a trial is being set up. During training the Trainer's own handlers take
    over: it finishes the step, saves a checkpoint and returns, and the trial is recorded
    FAIL (interrupted) and queued again to resume from that checkpoint.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self.interruptible = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pending is None:
            self.pending = signum
            if self.interruptible:
                raise StudyInterrupted(signum)

    def check(self) -> None:
        if self.pending is not None:
            raise StudyInterrupted(self.pending)

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """A stretch where a signal may raise at once."""
        self.check()
        self.interruptible = True
        try:
            yield
        finally:
            self.interruptible = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._handle) for s in signals}
        # Nested inside another's (the command's, installed first thing): a signal that came
        # before this took over is this one's, and one held here is the outer's afterwards.
        outer = getattr(previous[signal.SIGTERM], "__self__", None)
        outer = outer if isinstance(outer, Interrupts) else None
        if outer is not None and self.pending is None:
            self.pending = outer.pending
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if outer is not None and outer.pending is None:
                outer.pending = self.pending


def optuna() -> Any:
    return require("optuna", extra="optuna", feature="hookloop tune")


@dataclass
class TuneSpec:
    """Everything a worker needs to run trials of a study; saved as ``tune.yaml``."""

    recipe: str
    space: dict[str, Any]
    trials: int
    overrides: list[str] = field(default_factory=list)
    #: The objective: one metric, or a list of them (a multi-objective study).
    metric: str | list[str] = "eval_loss"
    #: ``minimize`` or ``maximize``, or a list with one per metric.
    direction: str | list[str] = "minimize"
    storage: str | None = None  # None: sqlite file study.db in the study directory
    study_name: str = "hookloop"
    seed: int = 0
    pruner: str = "median"
    max_failures: int | None = None  # None: as many as trials
    sampler: str = "tpe"
    #: Seconds between a running trial's heartbeats (Optuna's RDB heartbeat); a trial
    #: silent for twice as long is failed by any driver and retried. None: 30 with
    #: ``--storage``, off for the study's own SQLite file; 0: off.
    heartbeat: int | None = None
    sampler_args: dict[str, Any] = field(default_factory=dict)
    pruner_args: dict[str, Any] = field(default_factory=dict)
    #: ``METRIC <= NUMBER`` or ``METRIC >= NUMBER``: a trial that breaks one is infeasible.
    constraints: list[str] = field(default_factory=list)

    @property
    def metrics(self) -> list[str]:
        return [self.metric] if isinstance(self.metric, str) else list(self.metric)

    @property
    def directions(self) -> list[str]:
        given = [self.direction] if isinstance(self.direction, str) else list(self.direction)
        return given * len(self.metrics) if len(given) == 1 else given

    @property
    def multi_objective(self) -> bool:
        return len(self.metrics) > 1

    def parsed_constraints(self) -> list[Constraint]:
        return [Constraint.parse(text) for text in self.constraints]

    def validate(self, space_file: str | None = None) -> TuneSpec:
        """Check every field; a search-space error names ``space_file`` when given."""
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"--trials must be an int >= 1, got {self.trials!r}")
        check_objectives(self.metric, self.direction)
        if self.pruner not in PRUNERS:
            raise ValueError(f"--pruner must be one of {', '.join(PRUNERS)}, got {self.pruner!r}")
        if self.multi_objective and self.pruner != "none":
            raise ValueError(
                f"--pruner {self.pruner} cannot be used with several --metric "
                f"({', '.join(self.metrics)}): Optuna cannot prune a multi-objective trial; "
                "give --pruner none"
            )
        if self.multi_objective and self.sampler not in MULTI_OBJECTIVE_SAMPLERS:
            raise ValueError(
                f"--sampler {self.sampler} cannot optimise several --metric "
                f"({', '.join(self.metrics)}); allowed: {', '.join(MULTI_OBJECTIVE_SAMPLERS)}"
            )
        if not isinstance(self.constraints, list):
            raise ValueError(
                f"constraints must be a list of 'METRIC <= NUMBER' or 'METRIC >= NUMBER', "
                f"got {self.constraints!r}"
            )
        self.parsed_constraints()  # each one is well formed
        if self.constraints and self.sampler not in CONSTRAINED_SAMPLERS:
            raise ValueError(
                f"--sampler {self.sampler} does not take constraints (--constraint "
                f"{self.constraints[0]!r}); samplers that do: {', '.join(CONSTRAINED_SAMPLERS)}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be an int >= 0, got {self.seed!r}")
        if not self.study_name:
            raise ValueError("--study-name must not be empty")
        if self.sampler not in SAMPLERS:
            raise ValueError(
                f"--sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}"
            )
        for flag, args in (
            ("--sampler-args", self.sampler_args),
            ("--pruner-args", self.pruner_args),
        ):
            if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
                raise ValueError(
                    f"{flag} must be a mapping of argument names to values, got {args!r}"
                )
        base = self.base_config()
        try:
            self.search_space(base)  # every key exists and every end is allowed
        except ValueError as err:
            raise ValueError(f"search space {space_file or ''}: {err}".replace("  ", " ")) from None
        make_sampler(self, self.seed)  # the sampler and pruner take these arguments
        make_pruner(self.pruner, self.pruner_args)
        return self

    def base_config(self) -> Config:
        """The recipe's defaults with the command's overrides (what every trial starts from)."""
        return resolve_config(self.recipe, None, list(self.overrides))

    def search_space(self, base: Config | None = None) -> SearchSpace:
        return SearchSpace(self.space, base)

    def storage_url(self, study_dir: Path) -> str:
        return self.storage or f"sqlite:///{(study_dir / DB_FILE).resolve()}"

    def heartbeat_seconds(self) -> int | None:
        if self.heartbeat is None:
            return 30 if self.storage is not None else None
        return self.heartbeat or None

    def save(self, study_dir: Path) -> None:
        """Write ``tune.yaml``, with the storage URL's password masked (see
        :mod:`hookloop.tune.credentials`): this process keeps the whole URL in memory."""
        credentials.remember(self.storage)
        data = {**asdict(self), "storage": credentials.mask(self.storage)}
        (study_dir / SPEC_FILE).write_text(yaml.safe_dump(data, sort_keys=False))

    @classmethod
    def load(cls, study_dir: str | Path) -> TuneSpec:
        path = Path(study_dir) / SPEC_FILE
        if not path.is_file():
            raise ValueError(f"{study_dir} is not a study directory (no {SPEC_FILE})")
        data = yaml.safe_load(path.read_text())
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict):
            raise ValueError(f"{path} must be a mapping of {', '.join(fields)}")
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(fields)}")
        return cls(**{**data, "storage": credentials.restore(data.get("storage"))})

    def differences(self, other: TuneSpec) -> list[str]:
        return [k for k in IDENTITY if getattr(self, k) != getattr(other, k)]


def is_study_dir(path: str | Path) -> bool:
    return (Path(path) / SPEC_FILE).is_file()


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
    (:func:`recover_interrupted`, :func:`heartbeat`): Optuna's ``Study`` has no public
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
            storage = _storage(spec, study_dir)
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


#: Errors of drivers creating one fresh database's schema or study at once (retried).
_RACES = ("IntegrityError", "OperationalError", "ProgrammingError", "DuplicatedStudyError")


def _storage(spec: TuneSpec, study_dir: Path) -> Any:
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
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
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


def make_sampler(spec: TuneSpec, seed: int) -> Any:
    """The Optuna sampler ``--sampler`` names, with ``--sampler-args`` and ``seed``.

    ``grid`` walks every combination of the space's ``choices`` and int ranges (a float
    range needs a ``step``). Raises ``ValueError`` naming what is wrong.
    """
    import importlib.util

    samplers = optuna().samplers
    for module in _SAMPLER_NEEDS.get(spec.sampler, ()):
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"--sampler {spec.sampler} needs the package {module!r}: pip install {module}"
            )
    kwargs: dict[str, Any] = {"seed": seed, **spec.sampler_args}
    if spec.sampler == "grid":
        kwargs.setdefault("search_space", _grid(spec.search_space()))
    if spec.constraints and not trials_set_constraints():
        kwargs["constraints_func"] = constraint_values  # Optuna < 5 reads them this way
    cls = {
        "tpe": samplers.TPESampler,
        "random": samplers.RandomSampler,
        "grid": _grid_sampler(),
        "cmaes": samplers.CmaEsSampler,
        "qmc": samplers.QMCSampler,
        "gp": samplers.GPSampler,
        "nsga2": samplers.NSGAIISampler,
    }[spec.sampler]
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        if "constraints_func" in kwargs and "constraints_func" in str(err):
            raise ValueError(
                f"--sampler {spec.sampler} takes no constraints in Optuna "
                f"{optuna().__version__}; use tpe or nsga2, or a newer Optuna"
            ) from None
        raise ValueError(
            f"--sampler-args: {spec.sampler} ({cls.__name__}) refused {spec.sampler_args}: {err}"
        ) from None


def trials_set_constraints() -> bool:
    """Whether this Optuna's trials take ``trial.set_constraint`` (Optuna >= 5), which its
    samplers and ``best_trial(s)`` read; before that a sampler's ``constraints_func`` did."""
    return hasattr(optuna().trial.Trial, "set_constraint")


def constraint_values(trial: Any) -> list[float]:
    """A finished trial's constraint values (its ``constraint`` user attribute), the
    ``constraints_func`` of samplers in Optuna < 5."""
    return [float(v) for v in trial.user_attrs.get(CONSTRAINT_ATTR, [])]


def feasible(trial: Any) -> bool:
    """Whether ``trial`` meets all the study's constraints (every value <= 0)."""
    return all(v <= 0 for v in trial.user_attrs.get(CONSTRAINT_ATTR, []))


def _grid_sampler() -> type:
    """Optuna's GridSampler, less its ``study.stop()`` once the grid is covered (which
    only works inside ``study.optimize``; hookloop stops at ``--trials``, and past the
    grid's size the sampler draws its points again)."""

    class GridSampler(optuna().samplers.GridSampler):
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return GridSampler


def _grid(space: SearchSpace) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for p in space.params:
        if p.kind == "choices":
            grid[p.key] = list(p.choices or ())
        elif p.kind == "range" and (p.is_int or p.step is not None):
            step = p.step if p.step is not None else 1
            count = round((p.high - p.low) / step) + 1  # type: ignore[operator]
            grid[p.key] = [p.low + i * step for i in range(count)]  # type: ignore[operator]
        elif p.kind == "range":
            raise ValueError(
                f"--sampler grid: {p.key} is a float range without a step; give it "
                "{low, high, step} or {choices: [...]}"
            )
    return grid


def make_pruner(name: str, args: dict[str, Any] | None = None) -> Any:
    pruners = optuna().pruners
    defaults: dict[str, dict[str, Any]] = {
        "median": {"n_startup_trials": 5, "n_warmup_steps": 0},
        "percentile": {"percentile": 25.0, "n_startup_trials": 5},
    }
    cls = {
        "median": pruners.MedianPruner,
        "percentile": pruners.PercentilePruner,
        "hyperband": pruners.HyperbandPruner,
        "successive-halving": pruners.SuccessiveHalvingPruner,
        "threshold": pruners.ThresholdPruner,
        "none": pruners.NopPruner,
    }[name]
    kwargs = {**defaults.get(name, {}), **(args or {})}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"--pruner-args: {name} ({cls.__name__}) refused {args or {}}: {err}"
        ) from None


@contextlib.contextmanager
def study_lock(study_dir: Path) -> Iterator[None]:
    """An exclusive lock for claiming trials (released by the OS if the holder dies)."""
    with open(study_dir / LOCK_FILE, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class Counts:
    done: int  # COMPLETE or PRUNED
    running: int
    failed: int  # FAIL for a reason other than an interrupted process


def counts(study: Any) -> Counts:
    state = optuna().trial.TrialState
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return Counts(
        done=sum(t.state in (state.COMPLETE, state.PRUNED) for t in trials),
        running=sum(t.state == state.RUNNING for t in trials),
        failed=sum(
            t.state == state.FAIL
            and not t.user_attrs.get("interrupted", False)
            and not t.user_attrs.get("surplus", False)
            and t.number not in retried
            for t in trials
        ),
    )


def recover_interrupted(study: Any, storage: Any) -> list[int]:
    """Mark RUNNING trials whose process is gone FAIL, and enqueue their parameters again.

    Call it holding :func:`study_lock`, with the Optuna storage ``study`` was opened on
    (:func:`open_study_on_storage`). A trial is interrupted when its process ran on this
    host and is no longer alive, or when it has no process recorded at all (its claimer
    died holding the lock). Returns their numbers.
    """
    opt = optuna()
    study_id = storage.get_study_id_from_name(study.study_name)
    host = host_name()
    recovered = []
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(opt.trial.TrialState.RUNNING,)):
        pid, trial_host = trial.user_attrs.get("pid"), trial.user_attrs.get("host")
        if pid is not None and (trial_host != host or process_alive(int(pid))):
            continue  # alive, or another machine's: only its own host (or heartbeat) fails it
        started = trial.datetime_start or now
        if pid is None and (now - started).total_seconds() < UNCLAIMED_AFTER_S:
            continue  # just asked for, by this machine or another: its claimer is writing
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        reason = f"interrupted: process {pid} on {trial_host} died while the trial ran"
        try:
            storage.set_trial_user_attr(trial_id, "fail_reason", reason)
            storage.set_trial_user_attr(trial_id, "interrupted", True)
            storage.set_trial_state_values(trial_id, opt.trial.TrialState.FAIL)
        except opt.exceptions.UpdateFinishedTrialError:
            continue  # another driver on this machine recovered it first
        requeue(study, trial)
        recovered.append(trial.number)
    return recovered


def requeue(study: Any, trial: Any, reason: str | None = None) -> None:
    """Enqueue an interrupted trial's parameters again, with where its run directory is (the
    retry resumes from its newest checkpoint when that is on this machine)."""
    attrs: dict[str, Any] = {"retry_of": trial.number}
    if reason:
        attrs["retry_reason"] = reason
    if trial.user_attrs.get("run_dir"):
        attrs["resume_from"] = trial.user_attrs["run_dir"]
        attrs["resume_host"] = trial.user_attrs.get("host")
    if trial.intermediate_values:
        attrs["reported"] = {str(k): v for k, v in trial.intermediate_values.items()}
    params = dict(trial.params) or dict(trial.system_attrs.get("fixed_params", {}))
    study.enqueue_trial(params, user_attrs=attrs)


def take_over_run_dir(study_dir: Path, trial: Any) -> bool:
    """For a retry of an interrupted trial: move the interrupted trial's run directory (with
    its checkpoints) to this trial's, so that it resumes there. False (start from scratch)
    when that directory is on another machine or holds no checkpoint."""
    old = trial.user_attrs.get("resume_from")
    if not old or trial.user_attrs.get("resume_host") != host_name():
        return False
    old_dir, new_dir = Path(old), trial_dir(study_dir, trial.number)
    if not is_checkpoints_folder(RunDir(old_dir).checkpoints) or new_dir.exists():
        return False
    shutil.move(str(old_dir), str(new_dir))
    return True


class BestMetric(Callback):
    """What a trial is scored by: the best value of each objective metric over the run's
    evaluations (each in its own direction), the last evaluation's metrics (for the
    constraints) and the model's parameter count (``param_count``)."""

    priority = 84  # just before OptunaPruning (85): both read the same evaluation

    def __init__(self, metric: str | list[str], direction: str | list[str]) -> None:
        self.metrics = [metric] if isinstance(metric, str) else list(metric)
        given = [direction] if isinstance(direction, str) else list(direction)
        self.directions = given * len(self.metrics) if len(given) == 1 else given
        self.bests: dict[str, float] = {}
        self.nonfinite = False
        self.metric_names: set[str] = set()  # what the evaluations reported
        self.evaluations = 0
        self.last: dict[str, float] = {}  # the last evaluation's metrics
        self.param_count: int | None = None

    @property
    def best(self) -> float | None:
        """The first metric's best value (the single objective's)."""
        return self.bests.get(self.metrics[0])

    def on_train_start(self, ctx: CallbackContext) -> None:
        model = getattr(ctx, "model", None)
        if model is not None and hasattr(model, "parameters"):
            self.param_count = sum(p.numel() for p in model.parameters())

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training or ctx.metrics is None:
            return
        self.evaluations += 1
        self.metric_names.update(ctx.metrics)
        numbers = {k: as_float(v) for k, v in ctx.metrics.items()}
        self.last = {k: v for k, v in numbers.items() if v is not None}
        for metric, direction in zip(self.metrics, self.directions, strict=True):
            value = self.measured(metric)
            if value is None or metric == PARAM_COUNT:
                continue
            if not math.isfinite(value):
                self.nonfinite = True
                continue
            best = self.bests.get(metric)
            if best is None or (value < best if direction == "minimize" else value > best):
                self.bests[metric] = value

    def measured(self, name: str) -> float | None:
        """``name`` in the last evaluation, or the model's parameter count for ``param_count``."""
        if name == PARAM_COUNT and name not in self.last:
            return None if self.param_count is None else float(self.param_count)
        return self.last.get(name)

    def objective(self, name: str) -> float | None:
        if name == PARAM_COUNT and name not in self.metric_names:
            return self.measured(name)
        return self.bests.get(name)

    def state_dict(self) -> dict[str, Any]:  # a resumed trial keeps its earlier evaluations
        return {
            "best": self.best,
            "bests": dict(self.bests),
            "nonfinite": self.nonfinite,
            "metric_names": sorted(self.metric_names),
            "evaluations": self.evaluations,
            "last": dict(self.last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bests = dict(state.get("bests", {}))
        if not self.bests and state.get("best") is not None:  # saved by one-metric tracking
            self.bests = {self.metrics[0]: state["best"]}
        self.nonfinite = bool(state.get("nonfinite", False))
        self.metric_names = set(state.get("metric_names", ()))
        self.evaluations = int(state.get("evaluations", 0))
        self.last = dict(state.get("last", {}))


class _Tee:
    """A text stream that writes to ``stream`` and to ``copy``."""

    def __init__(self, stream: Any, copy: Any) -> None:
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        self._copy.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._copy.flush()
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def tee_output(path: Path) -> Iterator[None]:
    """Copy what this process prints (stdout and stderr, from Python) to ``path`` too."""
    with open(path, "a", encoding="utf-8", buffering=1) as handle:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, handle), _Tee(err, handle)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


def trial_dir(study_dir: Path, number: int) -> Path:
    return study_dir / f"trial-{number:04d}"


#: The stop reason of a trial stopped by :class:`HeldSignal`.
HELD_SIGNAL = "signal held by hookloop tune:"


class HeldSignal(Callback):
    """Stops the trial at the end of the step when a signal reached the study's handler
    rather than the Trainer's (it came while the trial was being set up, and the
    exception it raised was swallowed where it landed, e.g. in a finalizer)."""

    priority = 1

    def __init__(self, interrupts: Interrupts) -> None:
        self.interrupts = interrupts

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if self.interrupts.pending is not None:
            name = signal.Signals(self.interrupts.pending).name
            ctx.control.request_stop(f"{HELD_SIGNAL} {name}")


def train_trial(
    spec: TuneSpec,
    study_dir: Path,
    number: int,
    values: dict[str, Any],
    trial: Any = None,
    *,
    resume: bool = False,
    interrupts: Interrupts | None = None,
) -> tuple[Any, BestMetric]:
    """Train trial ``number`` with ``values`` in its run directory; every rank calls it.

    Rank 0 passes the Optuna ``trial`` (its pruner callback reports to it) and
    writes the run's ``config.yaml`` and ``params.yaml``; a prune is a stop
    request, which the loop agrees across ranks, so every rank stops at the same step.
    """
    from hookloop.callbacks.defaults import default_callbacks
    from hookloop.callbacks.optuna_pruning import OptunaPruning
    from hookloop.entry import build_trainer

    run_dir = trial_dir(study_dir, number)
    cfg = apply_params(copy.deepcopy(spec.base_config()), values).validate()
    if cfg.logging.wandb:  # W&B groups a study's trials (unless the caller chose a group)
        os.environ.setdefault("WANDB_RUN_GROUP", spec.study_name)
    best = BestMetric(spec.metric, spec.direction)
    callbacks = [*default_callbacks(cfg, run_dir), best]
    if interrupts is not None:
        callbacks.append(HeldSignal(interrupts))
    if trial is not None:
        run_dir.mkdir(parents=True, exist_ok=True)  # another rank may have made it
        RunDir(run_dir).config.write_text(dump_yaml(cfg.to_dict()))
        trial.set_user_attr("config", json.loads(json.dumps(cfg.to_dict(), default=str)))
        RunDir(run_dir).params.write_text(
            yaml.safe_dump({"study": spec.study_name, "trial": number, "params": values})
        )
        if not spec.multi_objective:  # Optuna cannot prune a multi-objective trial
            callbacks.append(OptunaPruning(trial, spec.metric, raise_pruned=False))
    resume_from = "auto" if resume else None
    result = build_trainer(cfg, callbacks=callbacks, out_dir=run_dir, resume=resume_from).train()
    return result, best


def run_trial(
    spec: TuneSpec,
    study_dir: Path,
    trial: Any,
    values: dict[str, Any],
    interrupts: Interrupts | None = None,
) -> None:
    """Train one trial (see :func:`train_trial`) and tell the study how it ended.

    COMPLETE with the best value of each ``metric`` over its evaluations (``inf``, or
    ``-inf`` when maximising, for a run that went NaN or never produced a finite value,
    as the HPO trainer scores it); PRUNED when the pruner stopped it; FAIL with the
    error when training raised. The reason is the trial's ``fail_reason`` or
    ``prune_reason`` user attribute. With constraints, a COMPLETE or PRUNED trial
    records their values first (see :func:`record_constraints`).
    """
    from hookloop.callbacks.nan_detection import is_nonfinite_stop
    from hookloop.callbacks.optuna_pruning import is_pruned_stop

    state = optuna().trial.TrialState
    resume = take_over_run_dir(study_dir, trial)
    if resume:  # the pruner sees the evaluations before the interruption again
        for step, value in sorted(trial.user_attrs.get("reported", {}).items()):
            trial.report(value, int(step))
    run_dir = trial_dir(study_dir, trial.number)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with (
            interrupts.allowed() if interrupts is not None else contextlib.nullcontext(),
            tee_output(run_dir / CONSOLE_LOG),
        ):
            result, best = train_trial(
                spec, study_dir, trial.number, values, trial, resume=resume, interrupts=interrupts
            )
    except StudyInterrupted as stop:  # a signal while the trial was being set up
        interrupted(trial, f"interrupted by {signal.Signals(stop.signum).name} before training")
        raise
    except Exception as err:  # the trial failed; the study goes on
        reason = f"{type(err).__name__}: {err}"
        trial.set_user_attr("fail_reason", reason)
        trial.set_user_attr("traceback", traceback.format_exc()[-4000:])
        trial.study.tell(trial, state=state.FAIL)
        print(f"hookloop tune: trial {trial.number} failed: {reason}", file=sys.stderr)
        return
    signum = result.signal
    if signum is None and (result.stop_reason or "").startswith(HELD_SIGNAL):
        signum = interrupts.pending if interrupts is not None else None
    if signum is not None:  # a partial run: FAIL, to resume from its checkpoint later
        name = signal.Signals(signum).name
        interrupted(trial, f"interrupted by {name} at step {result.step}")
        raise StudyInterrupted(signum)
    if is_pruned_stop(result.stop_reason):
        trial.set_user_attr("prune_reason", result.stop_reason)
        record_constraints(spec, trial, best)
        trial.study.tell(trial, state=state.PRUNED)
        return
    nonfinite = is_nonfinite_stop(result.stop_reason) or best.nonfinite
    missing = [m for m in spec.metrics if best.objective(m) is None]
    if missing and not nonfinite:  # a setup error, not a bad trial: say what is wrong
        reason = (
            f"--metric {missing[0]!r} is not among the evaluation metrics "
            f"{sorted(best.metric_names)} (or {PARAM_COUNT})"
            if best.evaluations
            else "no evaluation ran (set train.eval_every or train.eval_at_epoch_end)"
        )
        fail(trial, reason)
        return
    absent = [c.text for c in spec.parsed_constraints() if best.measured(c.metric) is None]
    if absent and not nonfinite:
        fail(
            trial,
            f"--constraint {absent[0]!r} names a metric the evaluations do not report "
            f"(they report {', '.join(sorted(best.metric_names))}, and {PARAM_COUNT})",
        )
        return
    values = []
    for metric, direction in zip(spec.metrics, spec.directions, strict=True):
        value = best.objective(metric)
        if nonfinite or value is None or not math.isfinite(value):
            trial.set_user_attr("fail_reason", f"no finite {metric}: {result.stop_reason}")
            value = math.inf if direction == "minimize" else -math.inf
        values.append(value)
    record_constraints(spec, trial, best)
    trial.study.tell(trial, values=values if spec.multi_objective else values[0])


def fail(trial: Any, reason: str) -> None:
    trial.set_user_attr("fail_reason", reason)
    trial.study.tell(trial, state=optuna().trial.TrialState.FAIL)
    print(f"hookloop tune: trial {trial.number} failed: {reason}", file=sys.stderr)


def record_constraints(spec: TuneSpec, trial: Any, best: BestMetric) -> None:
    """Store the trial's constraint values as Optuna's samplers read them: the user attribute
    ``constraint`` (one value per constraint, feasible when all are <= 0; a sampler's
    ``constraints_func`` in Optuna < 5) and, where Optuna has it, ``trial.set_constraint``.
    A constraint whose metric was never measured (a trial pruned before it) counts as met,
    one measured as NaN as broken."""
    constraints = spec.parsed_constraints()
    if not constraints:
        return
    values = []
    for c in constraints:
        measured = best.measured(c.metric)
        if measured is None:
            values.append(0.0)
        else:  # a NaN run breaks every constraint
            values.append(math.inf if math.isnan(measured) else c.value(measured))
    trial.set_user_attr(CONSTRAINT_ATTR, values)
    if trials_set_constraints():
        for c, value in zip(constraints, values, strict=True):
            trial.set_constraint(c.text, value)


def driver_salt(study_dir: Path) -> int:
    """A number that tells this driver's sampler seed from other drivers' on the same
    storage: from its host (``$HOOKLOOP_TUNE_HOST``) and its study directory."""
    return zlib.crc32(f"{host_name()}:{Path(study_dir).resolve()}".encode()) % 1_000_003


def surplus(study: Any, trial: Any, wanted: int) -> bool:
    """Whether ``trial``, just asked for, is one more than the study wants: drivers on
    other machines (whose claims no file lock orders) asked at the same moment. It is
    then recorded FAIL with ``surplus: true`` (not counted), its queued parameters go
    back to the queue, and the caller waits."""
    state = optuna().trial.TrialState
    trials = study.get_trials(deepcopy=False)
    done = sum(t.state in (state.COMPLETE, state.PRUNED) for t in trials)
    running = sorted(t.number for t in trials if t.state == state.RUNNING)
    if trial.number not in running or running.index(trial.number) < wanted - done:
        return False
    trial.set_user_attr("surplus", True)
    trial.set_user_attr("fail_reason", "surplus: the study's trials were all claimed")
    study.tell(trial, state=state.FAIL)
    frozen = study.trials[trial.number]
    if "retry_of" in frozen.user_attrs or frozen.system_attrs.get("fixed_params"):
        requeue(study, frozen)
    return True


def beat_once(study: Any, storage: Any, trial: Any) -> None:
    """Record one heartbeat of ``trial`` (on a storage that keeps them)."""
    if hasattr(storage, "record_heartbeat"):
        study_id = storage.get_study_id_from_name(study.study_name)
        storage.record_heartbeat(
            storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        )


@contextlib.contextmanager
def heartbeat(study: Any, storage: Any, trial: Any, interval: int | None) -> Iterator[None]:
    """Record Optuna's heartbeat for ``trial`` every ``interval`` seconds while it runs
    (``study.optimize`` does this itself; ask-and-tell must), so that when this machine is
    lost, another driver's ``fail_stale_trials`` fails the trial and it is retried."""
    if not interval or not hasattr(storage, "record_heartbeat"):
        yield
        return
    study_id = storage.get_study_id_from_name(study.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a missed beat is retried next time
                storage.record_heartbeat(trial_id)
            stop.wait(interval)

    thread = threading.Thread(target=beat, name="hookloop-tune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def interrupted(trial: Any, reason: str) -> None:
    """Record ``trial`` as cut short by a signal (FAIL, not counted) and queue it again."""
    trial.set_user_attr("fail_reason", reason)
    trial.set_user_attr("interrupted", True)
    trial.study.tell(trial, state=optuna().trial.TrialState.FAIL)
    requeue(trial.study, trial.study.trials[trial.number])
    print(f"hookloop tune: trial {trial.number} {reason}; it resumes on a restart", file=sys.stderr)


def work(
    study_dir: str | Path,
    worker: int = 0,
    *,
    deadline: float | None = None,
    on_trial_end: Callable[[Any], None] | None = None,
) -> int:
    """Claim and run trials until the study has its N COMPLETE or PRUNED trials.

    Returns the number of trials this worker ran. Raises :class:`TuneError`
    when more trials failed than ``max_failures`` allows. After ``deadline`` (a
    ``time.time()``) it starts no more trials. ``on_trial_end`` is called with each
    trial this worker ran (an ``optuna.trial.FrozenTrial``) once it is recorded. Under
    ``torchrun`` (a process group is up) rank 0 claims each trial and every other rank
    trains the same trial beside it (:func:`follow`).
    """
    from hookloop.distributed import broadcast_object, rank_info

    rank, _, world = rank_info()
    if world > 1 and rank != 0:
        return follow(study_dir)
    try:
        with Interrupts().installed() as interrupts:
            return _lead(
                Path(study_dir),
                worker,
                announce=world > 1,
                interrupts=interrupts,
                deadline=deadline,
                on_trial_end=on_trial_end,
            )
    finally:
        if world > 1:
            broadcast_object(None)  # the followers' signal to stop


def follow(study_dir: str | Path) -> int:
    """On ranks other than 0: train each trial rank 0 announces, until it announces None."""
    from hookloop.distributed import broadcast_object

    study_dir = Path(study_dir)
    spec = TuneSpec.load(study_dir)
    ran = 0
    while (claimed := broadcast_object(None)) is not None:
        number, values = claimed
        try:
            train_trial(spec, study_dir, number, values)
        except Exception as err:  # rank 0 records the failure; this rank waits for the next
            print(f"hookloop tune: trial {number} failed on this rank: {err}", file=sys.stderr)
        ran += 1
    return ran


def _lead(
    study_dir: Path,
    worker: int,
    *,
    announce: bool,
    interrupts: Interrupts,
    deadline: float | None = None,
    on_trial_end: Callable[[Any], None] | None = None,
) -> int:

    from hookloop.distributed import broadcast_object

    spec = TuneSpec.load(study_dir)
    space = spec.search_space()
    with study_lock(study_dir):
        # The sampler's seed differs per worker, per restart and (on a shared --storage) per
        # driver, so that no two draw the same values.
        start = len(open_study(spec, study_dir).get_trials(deepcopy=False))
    salt = driver_salt(study_dir) if spec.storage is not None else 0
    seed = (spec.seed + 1000 * worker + 7919 * start + salt) % 2**31
    study, storage = open_study_on_storage(spec, study_dir, sampler_seed=seed)
    max_failures = spec.max_failures if spec.max_failures is not None else spec.trials
    ran = 0
    while True:
        interrupts.check()
        if deadline is not None and time.time() >= deadline:
            return ran
        trial = None
        with study_lock(study_dir):
            with warnings.catch_warnings():  # Optuna marks it experimental
                warnings.simplefilter("ignore", optuna().exceptions.ExperimentalWarning)
                optuna().storages.fail_stale_trials(study)  # a lost machine's trials, retried
            recover_interrupted(study, storage)
            now = counts(study)
            if now.done >= spec.trials:
                return ran
            if now.failed >= max_failures:
                raise TuneError(
                    f"{now.failed} trials failed (the limit is {max_failures}); see their "
                    f"fail_reason in `hookloop tune` output or {study_dir}/trial-*/"
                )
            if now.done + now.running < spec.trials:
                with warnings.catch_warnings():  # hookloop records the heartbeats itself
                    warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
                    trial = study.ask()
                if spec.heartbeat_seconds():  # at once: a trial never heard from is never stale
                    beat_once(study, storage, trial)
                trial.set_user_attr("pid", os.getpid())
                trial.set_user_attr("host", host_name())
                trial.set_user_attr("run_dir", str(trial_dir(study_dir, trial.number)))
                if surplus(study, trial, spec.trials):
                    trial = None  # other drivers claimed the last trials at the same moment
                else:
                    values = space.suggest(trial)
        if trial is None:  # N trials are under way: wait in case one of them fails
            with interrupts.allowed():
                time.sleep(0.2)
            continue
        if announce:
            broadcast_object((trial.number, values))
        try:
            with heartbeat(study, storage, trial, spec.heartbeat_seconds()):
                run_trial(spec, study_dir, trial, values, interrupts)
        except optuna().exceptions.UpdateFinishedTrialError:
            finished_elsewhere(study.trials[trial.number], on_trial_end)
            continue
        except StudyInterrupted:
            if on_trial_end is not None:
                on_trial_end(study.trials[trial.number])
            raise
        if on_trial_end is not None:
            on_trial_end(study.trials[trial.number])
        ran += 1


def finished_elsewhere(trial: Any, on_trial_end: Callable[[Any], None] | None) -> None:
    """Another driver finished ``trial`` while this one ran it: it missed the trial's
    heartbeats (this machine was too busy to send them), failed it and queued it again.
    Its retry counts; this run of it is dropped, and the study goes on."""
    line = (
        f"hookloop tune: trial {trial.number} was ended ({trial.state.name}) by another "
        "driver while it ran here (a missed heartbeat); its retry counts, this run is dropped"
    )
    print(line, file=sys.stderr, flush=True)
    if on_trial_end is not None:
        on_trial_end(trial)
