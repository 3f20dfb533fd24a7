"""MLflow tracking: params, metrics by step, live changes and the run's files, in one MLflow run.

Written with ``mlflow.tracking.MlflowClient`` (from ``mlflow-skinny``, the ``mlflow`` extra),
so nothing of MLflow's process-wide "active run" is touched. Where it goes:

* **store**: ``tracking_uri`` (``logging.mlflow_uri``); ``hookloop train`` defaults it to a
  file store in the run directory, ``<run>/mlruns`` (``mlflow ui --backend-store-uri
  <run>/mlruns`` shows it).
* **experiment**: ``experiment`` (``logging.mlflow_experiment``), default the recipe's name,
  else ``"hookloop"``; created when missing.
* **params**: the run's resolved config, flattened (``train.max_steps``, ``optimizer.lr``).
* **metrics**: a log's numbers as ``train/<key>``, an evaluation's as ``eval/<key>``
  (``test/<key>``), at their step (names as TensorBoard and W&B get them).
* **live changes** (``hookloop ctl set``, :mod:`hookloop.loop.live`): a tag
  ``set.step<N>.<key>`` = ``old -> new (client)`` per change, and, for a number, a metric
  ``set/<key>`` at step N, so a plot shows when the learning rate was changed and to what.
* **at the end**: the run's ``config.yaml`` as an artifact, the last checkpoint's path as
  the tag ``hookloop.checkpoint``, the status as ``hookloop.status``; the MLflow run is
  ended FINISHED, FAILED (an exception) or KILLED (an interrupt).

MLflow names may hold letters, digits, ``_ - . / space`` only and up to 250 characters: a
key with anything else has those characters replaced by ``_``, and a longer one is cut
and given a hash of the whole key (:func:`mlflow_name`), so a hostile key never fails a run.

Resume: the MLflow run id is this logger's part of the checkpoint (:meth:`position`), and a
resumed training continues the same MLflow run. MLflow cannot delete a metric's points, so
a resume does not relog what the store holds: a point at a step at or below the last step
the store has for that metric is left out (a resumed training repeats the killed one's
steps with the same numbers). A **rewind** after a divergence trains the steps again with
other batches or another learning rate: those points are logged, so the history of a metric
holds two points at a rewound step, the old and the new; the tag ``rewind.<count>`` =
``from_step -> to_step`` marks where that happened. A resume that finds no checkpoint (a
run killed before its first save, restarted with ``--resume auto``) starts a new MLflow run.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from pathlib import Path
from typing import Any

from hookloop._optional import require
from hookloop.callbacks.jsonlog import metric_tag, numeric_metrics
from hookloop.callbacks.logger import Logger, Record, run_status
from hookloop.state import CallbackContext

__all__ = ["MLflowLogger", "flatten", "mlflow_name"]

#: MLflow's limits (mlflow.utils.validation): name length, param and tag value lengths.
MAX_NAME = 250
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
#: MLflow's ``log_batch`` takes at most this many params (and tags) at a time.
BATCH = 100


def import_mlflow() -> Any:
    """``mlflow.tracking``, or an ImportError naming the extra to install."""
    require("mlflow", extra="mlflow", feature="MLflowLogger")
    return require("mlflow.tracking", extra="mlflow", feature="MLflowLogger")


def _entities() -> Any:
    """``mlflow.entities``: Metric, Param, RunTag."""
    return require("mlflow.entities", extra="mlflow", feature="MLflowLogger")


class MLflowLogger(Logger):
    """Logs a training run to one MLflow run (rank 0 only; see the module doc).

    ``tracking_uri``: where (None: ``$MLFLOW_TRACKING_URI``, else ``<run>/mlruns``);
    ``experiment``: the experiment's name (None: the recipe's, else ``"hookloop"``);
    ``run_name``: the MLflow run's name (None: the run directory's name).
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
    ) -> None:
        for name, value in (("tracking_uri", tracking_uri), ("experiment", experiment)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        import_mlflow()  # fail now, naming the extra, rather than after the model is built
        super().__init__()
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.client: Any = None
        self.run_id: str | None = None
        self._logged_through: dict[str, int] = {}  # per metric: the store's last step (resume)
        self._config_file: Path | None = None
        self._checkpoint: str | None = None

    # -- the backend ------------------------------------------------------------------
    def prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        return numeric_metrics(values)  # a tensor is read now; strings and the like left out

    def open(self, ctx: CallbackContext) -> None:
        run_dir = ctx.run.dir
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None and run_dir is not None:
            uri = Path(run_dir.mlruns).resolve().as_uri()
        if uri is None:
            raise ValueError(
                "MLflowLogger needs a tracking_uri, $MLFLOW_TRACKING_URI or a run directory"
            )
        self.client = import_mlflow().MlflowClient(tracking_uri=uri)
        self._config_file = run_dir.config if run_dir is not None else None
        params = flatten(ctx.config.to_dict()) if hasattr(ctx.config, "to_dict") else {}
        if self.run_id is not None:
            self._continue(params)
            return
        name = self.experiment or getattr(ctx.config, "recipe", None) or "hookloop"
        found = self.client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else self.client.create_experiment(name)
        run_name = self.run_name or (run_dir.root.name if run_dir is not None else None)
        run = self.client.create_run(experiment_id, run_name=run_name)
        self.run_id = run.info.run_id
        self._log_params(params)

    def _continue(self, params: dict[str, str]) -> None:
        """A resumed run: mark it running again, learn what the store holds, add new params
        (a param MLflow holds cannot change: a new value goes to a ``resumed.`` tag)."""
        entities = _entities()
        self.client.update_run(self.run_id, status="RUNNING")
        data = self.client.get_run(self.run_id).data
        for key in data.metrics:
            history = self.client.get_metric_history(self.run_id, key)
            self._logged_through[key] = max((m.step for m in history), default=-1)
        new = {k: v for k, v in params.items() if k not in data.params}
        changed = {k: v for k, v in params.items() if k in data.params and data.params[k] != v}
        self._log_params(new)
        tags = [entities.RunTag(f"resumed.{k}"[:MAX_NAME], v) for k, v in changed.items()]
        for i in range(0, len(tags), BATCH):
            self.client.log_batch(self.run_id, tags=tags[i : i + BATCH])

    def _log_params(self, params: dict[str, str]) -> None:
        entities = _entities()
        items = [entities.Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH])

    def write(self, record: Record) -> None:
        """On the writer thread: metrics at the record's step; changes, rewinds, the end."""
        if self.client is None or self.run_id is None:
            return
        kind, values = record.kind, record.values
        if kind in ("train", "eval", "test"):
            self._log_metrics(
                {metric_tag(kind, k): v for k, v in numeric_metrics(values).items()}, record
            )
        elif kind == "set":
            key = values["key"]
            text = f"{values['old']!r} -> {values['new']!r} ({values['client']})"
            self._tag(f"set.step{record.step}.{key}", text)
            number = numeric_metrics({"new": values["new"]})
            if number:
                self._log_metrics({f"set/{key}": number["new"]}, record)
        elif kind == "rewind":
            text = f"{values.get('from_step')} -> {values.get('to_step')}"
            self._tag(f"rewind.{values.get('count')}", text)
        elif kind == "end":
            self._end(record)

    def _log_metrics(self, values: dict[str, float], record: Record) -> None:
        entities = _entities()
        stamp = int(record.time * 1000)
        metrics = []
        for key, value in values.items():
            name = mlflow_name(key)
            if record.step <= self._logged_through.get(name, -1):
                continue  # the store has it already (a resume repeats the killed run's steps)
            metrics.append(entities.Metric(name, value, stamp, record.step))
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def _tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, mlflow_name(key), value[:MAX_TAG_VALUE])

    def _end(self, record: Record) -> None:
        values = record.values
        status = values.get("status") or run_status(values.get("stop_reason"))
        self._tag("hookloop.status", str(status))
        if self._checkpoint is not None:
            self._tag("hookloop.checkpoint", self._checkpoint)
        if self._config_file is not None and self._config_file.is_file():
            self.client.log_artifact(self.run_id, str(self._config_file))
        ended = {"failed": "FAILED", "interrupted": "KILLED"}.get(str(status), "FINISHED")
        self.client.set_terminated(self.run_id, status=ended)

    def on_checkpoint_save(self, ctx: CallbackContext) -> None:
        if ctx.checkpoint_path is not None:
            self._checkpoint = str(ctx.checkpoint_path)
        super().on_checkpoint_save(ctx)

    def cut(self, step: int, saved: dict[str, Any] | None) -> None:
        """Continue the checkpoint's MLflow run (at :meth:`open`); points are not deleted."""
        if saved is not None and self.client is None:
            run_id = saved.get("run_id")
            self.run_id = run_id if isinstance(run_id, str) and run_id else None

    def position(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def release(self) -> None:
        self.client = None  # the run id stays: a later train() in this process continues it


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: ``{"train.max_steps": "20", ...}`` (values as text,
    cut to MLflow's length; names made valid by :func:`mlflow_name`)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[mlflow_name(name)] = str(value)[:MAX_PARAM_VALUE]
    return out


_NOT_ALLOWED = re.compile(r"[^/\w.\- ]")


def mlflow_name(key: str) -> str:
    """``key`` as a name MLflow accepts: other characters become ``_``, no empty, ``.`` or
    ``..`` path parts, at most 250 characters (a longer key ends in a hash of itself).

    >>> mlflow_name('eval/acc, "top-1"\\n')
    'eval/acc_ _top-1__'
    >>> len(mlflow_name("k" * 1000)), mlflow_name("a//../b")
    (250, 'a/_/_/b')
    """
    name = _NOT_ALLOWED.sub("_", str(key))
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(str(key).encode("utf-8")).hexdigest()[:10]
        name = name[: MAX_NAME - 11] + "-" + digest
    parts = ["_" if part in ("", ".", "..") else part for part in name.split("/")]
    name = "/".join(parts)
    if len(name) > MAX_NAME or posixpath.normpath(name) != name:  # still not a plain path
        name = name.replace("/", "_")[:MAX_NAME]
    return name
