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
import datetime
import fcntl
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Iterator
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
SAMPLERS = ("tpe", "random", "grid", "cmaes", "qmc", "gp")
#: What a sampler needs beyond Optuna (checked before the study starts).
_SAMPLER_NEEDS = {"cmaes": ("cmaes",), "qmc": ("scipy",), "gp": ("scipy",)}
#: Fields of the spec that make a study what it is: a restart must repeat them.
IDENTITY = (
    "recipe", "overrides", "space", "metric", "direction", "pruner", "seed", "study_name",
    "sampler", "sampler_args", "pruner_args",
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
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def optuna() -> Any:
    return require("optuna", extra="optuna", feature="hookloop tune")


@dataclass
class TuneSpec:
    """Everything a worker needs to run trials of a study; saved as ``tune.yaml``."""

    recipe: str
    space: dict[str, Any]
    trials: int
    overrides: list[str] = field(default_factory=list)
    metric: str = "eval_loss"
    direction: str = "minimize"
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

    def validate(self, space_file: str | None = None) -> TuneSpec:
        """Check every field; a search-space error names ``space_file`` when given."""
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"--trials must be an int >= 1, got {self.trials!r}")
        check_metric_name(self.metric)
        if self.direction not in DIRECTIONS:
            raise ValueError(
                f"--direction must be 'minimize' or 'maximize', got {self.direction!r}"
            )
        if self.pruner not in PRUNERS:
            raise ValueError(f"--pruner must be one of {', '.join(PRUNERS)}, got {self.pruner!r}")
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
        (study_dir / SPEC_FILE).write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @classmethod
    def load(cls, study_dir: str | Path) -> TuneSpec:
        path = Path(study_dir) / SPEC_FILE
        if not path.is_file():
            raise ValueError(f"{study_dir} is not a study directory (no {SPEC_FILE})")
        return cls(**yaml.safe_load(path.read_text()))

    def differences(self, other: TuneSpec) -> list[str]:
        return [k for k in IDENTITY if getattr(self, k) != getattr(other, k)]


def is_study_dir(path: str | Path) -> bool:
    return (Path(path) / SPEC_FILE).is_file()


def open_study(spec: TuneSpec, study_dir: Path, *, sampler_seed: int | None = None) -> Any:
    """Create or load the study on its storage (SQLite in the study directory by default).

    A storage that cannot be opened (an unknown URL scheme, a damaged ``study.db``) raises
    ``ValueError`` naming it, for the command to report in one line.
    """
    opt = optuna()
    seed = spec.seed if sampler_seed is None else sampler_seed
    for attempt in range(4):  # drivers starting together on a fresh database race to create it
        try:
            return opt.create_study(
                storage=_storage(spec, study_dir),
                study_name=spec.study_name,
                direction=spec.direction,
                sampler=make_sampler(spec, seed),
                pruner=make_pruner(spec.pruner, spec.pruner_args),
                load_if_exists=True,
            )
        except ValueError:
            raise
        except Exception as err:  # SQLAlchemy's and Optuna's errors share no base worth naming
            if attempt < 3 and type(err).__name__ in _RACES:
                time.sleep(0.2 + 0.3 * random.random() * (attempt + 1))
                continue
            where = study_dir / DB_FILE if spec.storage is None else f"--storage {spec.storage}"
            reason = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
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
    cls = {
        "tpe": samplers.TPESampler,
        "random": samplers.RandomSampler,
        "grid": _grid_sampler(),
        "cmaes": samplers.CmaEsSampler,
        "qmc": samplers.QMCSampler,
        "gp": samplers.GPSampler,
    }[spec.sampler]
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"--sampler-args: {spec.sampler} ({cls.__name__}) refused {spec.sampler_args}: {err}"
        ) from None


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


def recover_interrupted(study: Any) -> list[int]:
    """Mark RUNNING trials whose process is gone FAIL, and enqueue their parameters again.

    Call it holding :func:`study_lock`. A trial is interrupted when its
    process ran on this host and is no longer alive, or when it has no process
    recorded at all (its claimer died holding the lock). Returns their numbers.
    """
    opt = optuna()
    storage = study._storage  # the RDBStorage we opened; optuna has no public getter
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
    """Keeps the best value of ``metric`` over the run's evaluations (the trial's objective)."""

    priority = 84  # just before OptunaPruning (85): both read the same evaluation

    def __init__(self, metric: str, direction: str) -> None:
        self.metric = metric
        self.direction = direction
        self.best: float | None = None
        self.nonfinite = False
        self.metric_names: set[str] = set()  # what the evaluations reported
        self.evaluations = 0

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if not ctx.state.in_training or ctx.metrics is None:
            return
        self.evaluations += 1
        self.metric_names.update(ctx.metrics)
        value = as_float(ctx.metrics.get(self.metric))
        if value is None:
            return
        if not math.isfinite(value):
            self.nonfinite = True
            return
        if self.best is None or (
            value < self.best if self.direction == "minimize" else value > self.best
        ):
            self.best = value

    def state_dict(self) -> dict[str, Any]:  # a resumed trial keeps its earlier evaluations
        return {
            "best": self.best,
            "nonfinite": self.nonfinite,
            "metric_names": sorted(self.metric_names),
            "evaluations": self.evaluations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.nonfinite = bool(state.get("nonfinite", False))
        self.metric_names = set(state.get("metric_names", ()))
        self.evaluations = int(state.get("evaluations", 0))


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

    COMPLETE with the best ``metric`` of its evaluations (``inf``, or ``-inf``
    when maximising, for a run that went NaN or never produced a finite value,
    as seed 001 scores it); PRUNED when the pruner stopped it; FAIL with the
    error when training raised. The reason is the trial's ``fail_reason`` or
    ``prune_reason`` user attribute.
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
        trial.study.tell(trial, state=state.PRUNED)
        return
    nonfinite = is_nonfinite_stop(result.stop_reason) or best.nonfinite
    if best.best is None and not nonfinite:  # a setup error, not a bad trial: say what is wrong
        reason = (
            f"--metric {spec.metric!r} is not among the evaluation metrics "
            f"{sorted(best.metric_names)}"
            if best.evaluations
            else "no evaluation ran (set train.eval_every or train.eval_at_epoch_end)"
        )
        trial.set_user_attr("fail_reason", reason)
        trial.study.tell(trial, state=state.FAIL)
        print(f"hookloop tune: trial {trial.number} failed: {reason}", file=sys.stderr)
        return
    worst = math.inf if spec.direction == "minimize" else -math.inf
    value = best.best
    if nonfinite or value is None:
        trial.set_user_attr("fail_reason", f"no finite {spec.metric}: {result.stop_reason}")
        value = worst
    trial.study.tell(trial, values=value)


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


def beat_once(study: Any, trial: Any) -> None:
    """Record one heartbeat of ``trial`` (on a storage that keeps them)."""
    storage = study._storage  # optuna has no public getter
    if hasattr(storage, "record_heartbeat"):
        study_id = storage.get_study_id_from_name(study.study_name)
        storage.record_heartbeat(
            storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        )


@contextlib.contextmanager
def heartbeat(study: Any, trial: Any, interval: int | None) -> Iterator[None]:
    """Record Optuna's heartbeat for ``trial`` every ``interval`` seconds while it runs
    (``study.optimize`` does this itself; ask-and-tell must), so that when this machine is
    lost, another driver's ``fail_stale_trials`` fails the trial and it is retried."""
    storage = study._storage  # optuna has no public getter
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


def work(study_dir: str | Path, worker: int = 0, *, deadline: float | None = None) -> int:
    """Claim and run trials until the study has its N COMPLETE or PRUNED trials.

    Returns the number of trials this worker ran. Raises :class:`TuneError`
    when more trials failed than ``max_failures`` allows. After ``deadline`` (a
    ``time.time()``) it starts no more trials. Under ``torchrun``
    (a process group is up) rank 0 claims each trial and every other rank
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
) -> int:

    from hookloop.distributed import broadcast_object

    spec = TuneSpec.load(study_dir)
    space = spec.search_space()
    optuna().logging.set_verbosity(optuna().logging.WARNING)
    with study_lock(study_dir):
        # The sampler's seed differs per worker, per restart and (on a shared --storage) per
        # driver, so that no two draw the same values.
        start = len(open_study(spec, study_dir).get_trials(deepcopy=False))
    salt = driver_salt(study_dir) if spec.storage is not None else 0
    seed = (spec.seed + 1000 * worker + 7919 * start + salt) % 2**31
    study = open_study(spec, study_dir, sampler_seed=seed)
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
            recover_interrupted(study)
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
                    beat_once(study, trial)
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
        with heartbeat(study, trial, spec.heartbeat_seconds()):
            run_trial(spec, study_dir, trial, values, interrupts)
        ran += 1
