"""When to save and which checkpoints to keep, and one run's checkpoints as a whole.

:class:`SavePolicy` decides *when* (every N steps, at the end, on stop and signal
but never after an abort, on request) and which to keep (the last K, the best K by
a metric, and ``latest``). :class:`CheckpointManager` joins the policy and the
storage (:mod:`hookloop.checkpoint.storage`) for one run: it captures named state
into a :class:`SaveJob` whose :meth:`~SaveJob.run` is the whole commit protocol
(the same on the loop's thread or on a writer thread), applies retention, and finds
what a resume restores (the newest intact checkpoint, or a named one).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hookloop.callback import Stateful
from hookloop.checkpoint.state import (
    Saveable,
    SavedState,
    apply_state,
    bare_model,
    holds_sharded_model,
    model_of,
    read_state,
    save_state,
)
from hookloop.checkpoint.storage import (
    MODEL,
    CheckpointError,
    CheckpointStorage,
    read_manifest,
    resolve_checkpoint,
    step_of,
)
from hookloop.config import dump_yaml
from hookloop.distributed import barrier, broadcast_object, rank_info
from hookloop.errors import ConfigError
from hookloop.result import is_abort

log = logging.getLogger("hookloop.checkpoint")


@dataclass
class SavePolicy:
    """When to save and which checkpoints to keep."""

    every: int | None = None
    keep_last: int | None = 3
    save_on_end: bool = True
    monitor: str | None = None
    mode: str = "min"
    keep_best: int = 1

    def due(self, step: int) -> bool:
        if not self.every:
            return False
        return step % self.every == 0

    def to_keep(self, manifests: list[dict[str, Any]], latest: str | None) -> set[str]:
        """Names to keep: the newest ``keep_last``, the best ``keep_best``, and ``latest``."""
        by_step = sorted(manifests, key=lambda m: m.get("step", -1))
        keep = (
            {m["name"] for m in by_step}
            if self.keep_last is None
            else {m["name"] for m in by_step[-self.keep_last :]}
        )
        if self.monitor:
            scored = [m for m in manifests if isinstance(m.get("metric"), (int, float))]
            scored.sort(key=lambda m: m["metric"], reverse=self.mode == "max")
            keep |= {m["name"] for m in scored[: self.keep_best]}
        if latest:
            keep.add(latest)
        return keep


@dataclass
class SaveJob:
    """One captured save: stage, serialise, write and fsync, manifest, rename, ``latest``,
    retention. :meth:`run` is the whole commit protocol, the same whether it runs
    at once or on a writer thread (``checkpoint.async_save``)."""

    manager: CheckpointManager
    name: str
    state: Mapping[str, Saveable]
    step: int
    epoch: int
    config: dict[str, Any] | None
    metrics: dict[str, Any]

    @property
    def path(self) -> Path:
        """Where the checkpoint is committed."""
        return self.manager.storage.root / self.name

    def run(self) -> Path:
        return self.manager._write(self)


# -- the manager: policy + storage for one run ------------------------------------


class CheckpointManager:
    """Saves and resumes one run's checkpoints under ``root`` (``<run>/checkpoints``).

    It decides *when* (the policy) and commits *where* (the storage); the loop
    hands it the named state and fires the checkpoint events.
    """

    def __init__(
        self,
        root: str | Path,
        policy: SavePolicy,
        *,
        strict: bool = False,
        allow_restart: bool = False,
    ) -> None:
        self.storage = CheckpointStorage(root)
        self.policy = policy
        self.strict = strict
        self.allow_restart = allow_restart
        self.last_saved_step: int | None = None
        self._read: SavedState | None = None  # the checkpoint find() read, until restored

    @classmethod
    def from_config(cls, config: Any, root: str | Path, *, resuming: bool) -> CheckpointManager:
        """From a :class:`~hookloop.config.CheckpointConfig`; refuses to start over a used root."""
        policy = SavePolicy(
            config.every,
            config.keep_last,
            config.save_on_end,
            config.monitor,
            config.mode,
            config.keep_best,
        )
        manager = cls(root, policy, strict=config.strict_resume, allow_restart=config.allow_restart)
        if not resuming and manager.storage.complete():
            raise ConfigError(
                f"{manager.storage.root} already holds checkpoints of a run; continue it with "
                "resume='auto' (CLI: --resume auto) or choose another output directory"
            )
        return manager

    # -- when
    def due(self, step: int, *, requested: bool = False) -> bool:
        """At a step boundary: the interval is due, or a save was requested."""
        return requested or self.policy.due(step)

    def due_at_end(self, stop_reason: str | None) -> bool:
        """At the end of training: never after an abort, always after a stop or signal,
        else if save_on_end."""
        if is_abort(stop_reason):
            return False
        stopped = (stop_reason or "") not in ("max_steps", "max_epochs", "finished", "")
        return stopped or self.policy.save_on_end

    # -- saving
    def save(
        self,
        state: Mapping[str, Stateful],
        *,
        step: int,
        epoch: int,
        config: dict[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Commit ``state`` as checkpoint ``step``; every rank calls it.

        Returns the checkpoint's path, or None when this step is already saved.
        """
        job = self.capture(state, step=step, epoch=epoch, config=config, metrics=metrics)
        return None if job is None else job.run()

    def capture(
        self,
        state: Mapping[str, Stateful],
        *,
        step: int,
        epoch: int,
        config: dict[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        copy: Callable[[Mapping[str, Saveable]], Mapping[str, Saveable]] | None = None,
    ) -> SaveJob | None:
        """The part of a save that must see this step's state; the job returned commits it.

        Without ``copy`` the job reads the live objects, so run it at once. With
        ``copy`` (:class:`hookloop.async_save.HostCopy`) every entry's state is
        copied off the live objects here, and the job may run on another thread
        while training goes on (one process, unsharded model). None when this
        step is already saved.
        """
        if self.last_saved_step == step:
            return None  # this exact state is already on disk
        self.last_saved_step = step
        saved: Mapping[str, Saveable] = state
        if copy is not None:
            saved = copy({**state, MODEL: bare_model(model_of(state))})
        return SaveJob(self, f"step-{step:08d}", saved, step, epoch, config, dict(metrics or {}))

    def _write(self, job: SaveJob) -> Path:
        """The commit protocol of one save (see :class:`SaveJob`)."""
        name = job.name
        rank_zero = rank_info()[0] == 0
        staging = self.storage.stage(name) if rank_zero else None
        if holds_sharded_model(job.state):
            staging = Path(broadcast_object(str(staging) if rank_zero else ""))
        try:
            path = self._commit(
                name, job.state, staging, job.step, job.epoch, job.config, job.metrics
            )
        except OSError as err:  # a full disk, a lost mount: the last commit still stands
            if rank_zero:
                self.storage.clean_incomplete()
            raise OSError(
                err.errno,
                f"could not write checkpoint {name} ({err.strerror or err}); the latest "
                f"checkpoint is still {self.storage.latest_name() or 'none'}, nothing was lost",
            ) from err
        barrier()
        return path

    def _commit(
        self,
        name: str,
        state: Mapping[str, Saveable],
        staging: Path | None,
        step: int,
        epoch: int,
        config: dict[str, Any] | None,
        metrics: Mapping[str, Any] | None,
    ) -> Path:
        captured = save_state(state, staging or self.storage.root)
        path = self.storage.root / name
        if captured is not None:  # rank 0, which staged the save in _write
            assert staging is not None
            files, written = captured
            if config is not None:
                files["config.yaml"] = dump_yaml(config).encode()
            meta: dict[str, Any] = {"step": step, "epoch": epoch, "time": time.time()}
            if self.policy.monitor:
                meta["metric"] = _monitored(dict(metrics or {}), self.policy.monitor)
            entries: dict[str, dict[str, Any]] = {}
            for directory in written:  # DCP returns once every rank has written its shards
                entries.update(self.storage.entries_on_disk(staging, directory.name))
            entries.update(self.storage.write(staging, files))
            path = self.storage.publish(name, staging, entries, meta)
            self._apply_retention()
        return path

    def _apply_retention(self) -> None:
        """Delete what the policy does not keep, ordered by the steps in the directory names:
        a damaged manifest can neither make an old checkpoint look new nor a new one old."""
        dirs = self.storage.complete()
        manifests = [{**read_manifest(p), "name": p.name, "step": step_of(p)} for p in dirs]
        keep = self.policy.to_keep(manifests, self.storage.latest_name())
        for p in dirs:
            if p.name not in keep:
                self.storage.delete(p)

    # -- resuming
    def find(self, target: str, state: Mapping[str, Stateful] | None = None) -> Path | None:
        """The verified checkpoint ``target`` names: ``"auto"`` (newest intact, or None)
        or a path to a checkpoint, a checkpoints folder or a run directory.

        With ``state`` (what a resume will restore) the checkpoint is also read and
        checked against it (:func:`~hookloop.checkpoint.state.read_state`), so that
        ``"auto"`` passes over one whose files do not load; :meth:`restore` then applies
        what was read.
        """
        if target == "auto":
            path = self._newest_intact(state)
            if path is None:
                log.info(
                    "hookloop: no checkpoint to resume in %s; starting fresh", self.storage.root
                )
            return path
        path = resolve_checkpoint(target)
        self.check(path, state)  # raises CheckpointError naming the file and problem
        return path

    def check(self, path: Path, state: Mapping[str, Stateful] | None = None) -> None:
        """Verify checkpoint ``path`` (files, manifest, identity) and, given ``state``, read
        it for a :meth:`restore`; a damaged one raises :class:`CheckpointError`."""
        manifest = self.storage.verify(path)
        if state is not None:
            self._read = read_state(state, path, step=manifest["step"])

    def restore(self, path: Path, state: Mapping[str, Stateful]) -> None:
        """Apply checkpoint ``path`` to ``state`` (what :meth:`check` read, else read now)."""
        saved = self._read if self._read is not None and self._read.path == path else None
        self._read = None
        if saved is None:
            manifest = self.storage.verify(path)
            saved = read_state(state, path, step=manifest["step"])
        apply_state(state, saved)
        self.last_saved_step = step_of(path)

    def load(self, target: str, state: Mapping[str, Stateful]) -> Path | None:
        """Restore ``state`` from ``target`` (see :meth:`find`); None if nothing to resume."""
        path = self.find(target, state)
        if path is not None:
            self.restore(path, state)
        return path

    def _newest_intact(self, state: Mapping[str, Stateful] | None = None) -> Path | None:
        """The newest checkpoint that verifies (and reads, given ``state``); older ones are
        tried in turn, each one skipped named in a warning.

        Checkpoints are ordered by the steps in their directory names. The one ``latest``
        names is tried like the others; when it is not the one resumed from, the warning
        says so. When checkpoints exist but none is intact, starting over would silently
        throw the run away: that raises, listing each and why, unless ``allow_restart``
        (``--allow-restart``) says to start fresh.
        """
        damaged = []
        latest = self.storage.latest_name()
        candidates = self.storage.complete()
        for path in reversed(candidates):
            try:
                self.check(path, state)
            except CheckpointError as err:
                damaged.append(f"{path.name}: {err}")
                pointed = " (the one 'latest' names)" if path.name == latest else ""
                warnings.warn(  # once: a warning, not also a log line (it printed twice)
                    f"hookloop resume: skipping damaged checkpoint {path.name}{pointed}: {err}; "
                    "trying an older one",
                    stacklevel=3,
                )
                continue
            latest_lost = (  # 'latest' names a newer checkpoint that is gone or damaged
                latest is not None
                and latest not in {p.name for p in candidates}
                and step_of(self.storage.root / latest) > step_of(path)
            )
            if latest_lost:
                warnings.warn(
                    f"hookloop resume: 'latest' names {latest}, which is not there or has no "
                    f"manifest; resuming from {path.name}",
                    stacklevel=3,
                )
            return path
        if damaged and not self.allow_restart:
            raise CheckpointError(
                f"no intact checkpoint to resume in {self.storage.root} "
                f"({len(damaged)} damaged: {'; '.join(damaged)}); repair or remove them, or "
                "start over with --allow-restart (checkpoint.allow_restart=true)"
            )
        if damaged:
            warnings.warn(
                f"hookloop resume: every checkpoint in {self.storage.root} is damaged; starting "
                "over as checkpoint.allow_restart asks",
                stacklevel=3,
            )
        return None


def _monitored(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) else None
