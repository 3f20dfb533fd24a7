"""The layout of a run directory: the one place that names its parts.

Everything one training run leaves behind lives under one directory::

    <run>/
      config.yaml      the resolved config (recipe defaults + file + overrides)
      metrics.jsonl    JSON Lines: one record per log, evaluation, start and end
      metrics.csv      the same numbers as a CSV table (logging.csv)
      mlruns/          a local MLflow store (logging.mlflow)
      tb/              TensorBoard event files
      checkpoints/     step-XXXXXXXX/ checkpoint directories and the "latest" pointer
      local_checkpoints/  the newest local (non-persistent) checkpoint (checkpoint.local_every)
      samples.txt      text generated during training (text-generation recipes)
      progress.txt     Megatron-style progress log: job starts, throughput at each save
      plots/           figures from `hookloop plot`
      profile/         torch.profiler traces and summary tables
      wandb/           Weights & Biases files
      params.yaml      a `hookloop tune` trial's study, number and searched values
      .lock            who is training into it (hookloop.runlock)

Writers (the loggers, the checkpoint manager, `hookloop plot`, `hookloop tune`) and
readers (`hookloop runs`) ask :class:`RunDir` for a path instead of spelling it out,
so moving a part is a one-line change. Callbacks reach it as ``ctx.run.dir``.

A run directory is one run's: :func:`enclosing_run` finds the run directory or checkpoint
a path lies inside (symlinks and ``..`` resolved), so that a new run's ``--out`` or
``checkpoint.local_dir`` is refused there instead of writing into another run's files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hookloop.journal import read_records

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"
MLRUNS_DIR = "mlruns"
TB_DIR = "tb"
CHECKPOINTS_DIR = "checkpoints"
LOCAL_CHECKPOINTS_DIR = "local_checkpoints"
SAMPLES_FILE = "samples.txt"
PROGRESS_FILE = "progress.txt"
CHANGES_FILE = "changes.jsonl"
PLOTS_DIR = "plots"
PROFILE_DIR = "profile"
WANDB_DIR = "wandb"
PARAMS_FILE = "params.yaml"
LOCK_FILE = ".lock"
#: What a checkpoint directory and a checkpoints folder hold (hookloop.checkpoint.storage).
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"


@dataclass(frozen=True)
class RunDir:
    """Paths of the parts of the run directory ``root`` (nothing is created here)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def metrics_csv(self) -> Path:
        return self.root / CSV_FILE

    @property
    def mlruns(self) -> Path:
        """A local MLflow store, unless ``logging.mlflow_uri`` names another."""
        return self.root / MLRUNS_DIR

    @property
    def tensorboard(self) -> Path:
        return self.root / TB_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def local_checkpoints(self) -> Path:
        """Where local checkpoints go unless ``checkpoint.local_dir`` says otherwise."""
        return self.root / LOCAL_CHECKPOINTS_DIR

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES_FILE

    @property
    def changes(self) -> Path:
        """Every live ``set`` applied to the run (:mod:`hookloop.loop.live`)."""
        return self.root / CHANGES_FILE

    @property
    def progress_log(self) -> Path:
        return self.root / PROGRESS_FILE

    @property
    def plots(self) -> Path:
        return self.root / PLOTS_DIR

    @property
    def profile(self) -> Path:
        return self.root / PROFILE_DIR

    @property
    def wandb(self) -> Path:
        return self.root / WANDB_DIR

    @property
    def params(self) -> Path:
        """A ``hookloop tune`` trial's ``{study, trial, params}`` (no other run has one)."""
        return self.root / PARAMS_FILE

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    def is_run(self) -> bool:
        """Whether ``root`` looks like a run directory (it has a metrics log or a config)."""
        return self.metrics.is_file() or self.config.is_file()

    @classmethod
    def of_checkpoint(cls, path: str | Path) -> RunDir:
        """The run directory a checkpoint (or a checkpoints folder) belongs to."""
        path = Path(path)
        if (path / CHECKPOINTS_DIR).is_dir():  # the run directory itself
            return cls(path)
        if path.name == CHECKPOINTS_DIR:
            return cls(path.parent)
        if path.parent.name == CHECKPOINTS_DIR:
            return cls(path.parent.parent)
        return cls(path.parent)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a run that trained (a metrics log or checkpoints); a
    ``config.yaml`` or a ``.lock`` alone does not count (a project folder may have one,
    pytest's temporary root has a ``.lock``)."""
    run = RunDir(path)
    return run.metrics.is_file() or is_checkpoints_folder(run.checkpoints)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (it has a manifest)."""
    return (path / MANIFEST_FILE).is_file()


def is_checkpoints_folder(path: Path) -> bool:
    """Whether ``path`` holds checkpoints (a ``latest`` pointer or a ``step-*`` checkpoint)."""
    if not path.is_dir():
        return False
    return (path / LATEST_FILE).is_file() or any(is_checkpoint(p) for p in path.glob("step-*"))


def enclosing_run(path: str | Path) -> tuple[Path, str] | None:
    """The innermost run directory, checkpoints folder or checkpoint that ``path`` lies inside
    (``path`` itself not counted), with what it is; None when it lies in none.

    The path is resolved first (symlinks, ``..``), so no spelling gets around it.
    """
    resolved = Path(os.path.realpath(path))
    for parent in resolved.parents:
        if is_checkpoint(parent):
            return parent, "the checkpoint"
        if is_checkpoints_folder(parent):
            return parent, "the checkpoints folder"
        if is_run_dir(parent):
            return parent, "the run directory"
    return None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file (metrics.jsonl), skipping a line torn by a killed
    writer (:func:`hookloop.journal.read_records`)."""
    return read_records(path)
