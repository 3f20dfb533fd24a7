"""What a study is: its command (:class:`TuneSpec`, saved as ``tune.yaml``), the layout
of its directory, and the Optuna sampler and pruner the command names.

Everything here is checked before a study starts (:meth:`TuneSpec.validate`), so that a
mistyped metric, sampler or search-space key is one line at the prompt rather than N
failed trials. A restart must repeat the fields that make the study what it is
(:data:`IDENTITY`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hookloop._optional import require
from hookloop.callbacks.monitor import check_metric_name
from hookloop.config import Config
from hookloop.recipes import resolve_config
from hookloop.tune import credentials
from hookloop.tune.space import SearchSpace

# A study directory: the command, the storage (unless --storage names another), the lock
# drivers claim trials under, the best trial's config, and in each trial-NNNN/ its output.
SPEC_FILE = "tune.yaml"
DB_FILE = "study.db"
LOCK_FILE = ".tune.lock"
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


class TuneError(RuntimeError):
    """A study that cannot go on (too many failed trials, a changed command …)."""


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


def optuna() -> Any:
    """The ``optuna`` module, or an error naming the extra that installs it."""
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


def make_sampler(spec: TuneSpec, seed: int) -> Any:
    """The Optuna sampler ``--sampler`` names, with ``--sampler-args`` and ``seed``.

    ``grid`` walks every combination of the space's ``choices`` and int ranges (a float
    range needs a ``step``). Raises ``ValueError`` naming what is wrong.
    """
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

    # Optuna is imported on first use, so mypy sees the base as a value.
    class GridSampler(optuna().samplers.GridSampler):  # type: ignore[misc]  # see above
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return GridSampler


def _grid(space: SearchSpace) -> dict[str, list[Any]]:
    """Every value the grid sampler walks, per key: the choices, or a range's steps."""
    grid: dict[str, list[Any]] = {}
    for p in space.params:
        if p.kind == "choices":
            grid[p.key] = list(p.choices or ())
        elif p.kind == "range" and (p.is_int or p.step is not None):
            low, high = p.low, p.high
            assert low is not None and high is not None  # a range has both ends
            step = p.step if p.step is not None else 1
            count = round((high - low) / step) + 1
            grid[p.key] = [low + i * step for i in range(count)]
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


def trial_dir(study_dir: Path, number: int) -> Path:
    return study_dir / f"trial-{number:04d}"
