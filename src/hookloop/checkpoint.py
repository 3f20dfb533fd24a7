"""Checkpoints: what is saved, where it is written, and when.

- *What*: a mapping ``{name: object with state_dict/load_state_dict}`` handed
  over by the loop (:func:`save_state` / :func:`load_state`). ``model`` and
  ``optimizer`` get files of their own (``model.safetensors`` and
  ``optimizer.pt``, or DCP shards when the model is sharded); every other
  entry goes into ``trainer_state.pt`` under its name. An entry marked
  ``per_rank`` (the RNG) is gathered from every rank. Nothing here knows the
  Trainer: a checkpoint can be written and read with a bare model and optimizer.
- *Where* (:class:`CheckpointStorage`): an atomic commit. Files go into a
  staging directory and are fsynced; ``manifest.json`` with every file's size
  and SHA-256 is written last; the directory is renamed into place; the
  ``latest`` pointer is replaced atomically. A directory without a valid
  manifest is never loaded and is removed by the next save.
- *When* (:class:`SavePolicy`): every N steps, at the end, on stop and
  signal (not abort), on request; keep the last K and the best K by a metric.

:class:`CheckpointManager` joins the three for one run; the loop asks it to
save and load and fires ``on_checkpoint_save`` / ``on_checkpoint_load`` itself.
:func:`load_weights` reads only a model's weights (finetuning), from the same
layout, with the same errors.

Layout under ``<run>/checkpoints/``::

    step-00000070/  model.safetensors  optimizer.pt  trainer_state.pt
                    config.yaml        manifest.json
    latest          (text: the name of the newest complete checkpoint)

A model sharded by FSDP2 (``train.parallel=fsdp``) has no single copy of its
weights, so model and optimizer go through ``torch.distributed.checkpoint``
instead: every rank writes its own shards into ``sharded/`` of the same
staging directory, and the manifest lists those files like any other::

    step-00000070/  sharded/.metadata  sharded/__0_0.distcp  sharded/__1_0.distcp
                    trainer_state.pt   config.yaml           manifest.json
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookloop.callback import Stateful
from hookloop.config import dump_yaml
from hookloop.distributed import (
    barrier,
    broadcast_object,
    gather_objects,
    is_distributed,
    is_sharded,
    rank_info,
)
from hookloop.result import is_abort
from hookloop.rundir import CHECKPOINTS_DIR

log = logging.getLogger("hookloop.checkpoint")

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1
#: Crash-safety testing: ``POINT`` or ``POINT@STEP`` makes the process die (``os._exit``)
#: at that point of the save protocol (at the save of checkpoint STEP, if given);
#: ``enospc`` or ``enospc@STEP`` makes the save fail once its files are written, as a
#: full disk would (an ``OSError``; the process goes on to report it).
FAULT_ENV = "HOOKLOOP_CHECKPOINT_FAULT"
FAULT_POINTS = ("files_written", "manifest_written", "renamed", "latest_staged", "committed")
#: Subdirectory of a checkpoint holding a sharded model and optimizer (DCP format).
SHARDED_DIR = "sharded"
#: Entries of the named state that get files of their own; every other entry goes
#: into STATE_FILE under its name.
MODEL, OPTIMIZER = "model", "optimizer"
STATE_FILE = "trainer_state.pt"


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, or not this model's."""


# -- where: atomic storage -----------------------------------------------------


class CheckpointStorage:
    """Atomic, verified checkpoint directories under one root."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def commit(self, name: str, files: dict[str, bytes], meta: dict[str, Any]) -> Path:
        """Write ``files`` as checkpoint ``name`` atomically; return its final path."""
        staging = self.stage(name)
        return self.publish(name, staging, self.write(staging, files), meta)

    def stage(self, name: str) -> Path:
        """A fresh, empty staging directory for checkpoint ``name`` (leftovers removed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_incomplete()
        staging = self.root / f".staging-{name}-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        return staging

    def write(self, staging: Path, files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
        """Write and fsync ``files`` into ``staging``; return their manifest entries."""
        entries = {}
        for fname, data in files.items():
            _write_synced(staging / fname, data)
            entries[fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return entries

    def entries_on_disk(self, staging: Path, subdir: str) -> dict[str, dict[str, Any]]:
        """Manifest entries of files other writers put under ``staging/subdir`` (fsynced)."""
        entries = {}
        for fpath in sorted((staging / subdir).rglob("*")):
            if fpath.is_file():
                _fsync(fpath)
                key = fpath.relative_to(staging).as_posix()
                entries[key] = {"size": fpath.stat().st_size, "sha256": _sha256(fpath)}
        _fsync(staging / subdir)
        return entries

    def publish(
        self, name: str, staging: Path, entries: dict[str, dict[str, Any]], meta: dict[str, Any]
    ) -> Path:
        """Write the manifest last, rename ``staging`` into place, point ``latest`` at it."""
        _fault("files_written", meta.get("step"))
        manifest = {"format": FORMAT_VERSION, "name": name, "files": entries, **meta}
        _write_synced(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync(staging)
        _fault("manifest_written", meta.get("step"))
        final = self.root / name
        if final.exists():  # same step saved again (e.g. on request, then at the end)
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync(self.root)
        _fault("renamed", meta.get("step"))
        pointer = self.root / f".{LATEST}.tmp"
        _write_synced(pointer, name.encode())
        _fault("latest_staged", meta.get("step"))
        os.replace(pointer, self.root / LATEST)
        _fsync(self.root)
        _fault("committed", meta.get("step"))
        return final

    def complete(self) -> list[Path]:
        """Checkpoint directories that have a manifest, oldest first (by step)."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()
        ]
        return sorted(found, key=lambda p: (_step_of(p), p.name))

    def latest_name(self) -> str | None:
        pointer = self.root / LATEST
        return pointer.read_text().strip() if pointer.is_file() else None

    def verify(self, path: str | Path) -> dict[str, Any]:
        """Return the manifest if it is valid and every file is present and intact.

        Anything else raises :class:`CheckpointError` naming the file and the
        reason: a manifest that breaks the schema (:func:`check_manifest`), a
        file on disk that the manifest does not list, a missing, truncated or
        altered file.
        """
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(
                f"checkpoint {path} has no {MANIFEST}: it was never completed (torn save)"
            )
        try:
            manifest = json.loads(manifest_path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise CheckpointError(f"{manifest_path} is corrupt: not valid JSON ({err})") from None
        files = check_manifest(manifest, manifest_path)
        on_disk = {
            p.relative_to(path).as_posix()
            for p in path.rglob("*")
            if p.is_file() and p.name != MANIFEST
        }
        unlisted = sorted(on_disk - set(files))
        if unlisted:
            raise CheckpointError(
                f"checkpoint {path} holds {unlisted[0]!r}, which its {MANIFEST} does not list "
                "(a file not covered by the manifest is never loaded)"
            )
        for fname, entry in files.items():
            fpath = path / fname
            if not fpath.is_file():
                raise CheckpointError(f"checkpoint file {fpath} is missing")
            size = fpath.stat().st_size
            if size != entry["size"]:
                raise CheckpointError(
                    f"checkpoint file {fpath} is truncated or altered: {size} bytes, "
                    f"manifest says {entry['size']}"
                )
            if _sha256(fpath) != entry["sha256"]:
                raise CheckpointError(
                    f"checkpoint file {fpath} fails its checksum (corrupted since it was saved)"
                )
        return manifest

    def clean_incomplete(self) -> None:
        """Remove staging leftovers and directories without a manifest."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.name.startswith(".staging-") or (
                p.is_dir() and p.name.startswith("step-") and not (p / MANIFEST).is_file()
            ):
                shutil.rmtree(p, ignore_errors=True)
            elif p.name == f".{LATEST}.tmp" or (p.name.startswith(".model-") and p.is_file()):
                p.unlink(missing_ok=True)

    def delete(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


_MANIFEST_KEYS = {"format", "name", "step", "epoch", "time", "metric", "files"}
_SHA256_HEX = frozenset("0123456789abcdef")


def check_manifest(manifest: Any, where: Path) -> dict[str, dict[str, Any]]:
    """Validate a manifest against its schema; return its ``files`` table.

    Every field is checked for presence, type and range; unknown fields and
    format versions are refused; the files a checkpoint needs must be listed.
    A violation raises :class:`CheckpointError` naming ``where`` and the reason.
    """

    def corrupt(reason: str) -> CheckpointError:
        return CheckpointError(f"{where} is corrupt: {reason}")

    if not isinstance(manifest, dict):
        raise corrupt(f"expected a JSON object, found {type(manifest).__name__}")
    unknown = sorted(set(manifest) - _MANIFEST_KEYS)
    if unknown:
        raise corrupt(
            f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(_MANIFEST_KEYS))})"
        )
    version = manifest.get("format")
    if not _is_int(version):
        raise corrupt(f"'format' must be an integer, found {version!r}")
    if version != FORMAT_VERSION:
        raise corrupt(
            f"format version {version} is not one this hookloop reads ({FORMAT_VERSION}); "
            "was it written by a newer hookloop?"
        )
    if not isinstance(manifest.get("name"), str) or not manifest["name"]:
        raise corrupt(f"'name' must be a non-empty string, found {manifest.get('name')!r}")
    for key in ("step", "epoch"):
        if not _is_int(manifest.get(key)) or manifest[key] < 0:
            raise corrupt(f"{key!r} must be an integer >= 0, found {manifest.get(key)!r}")
    if not _is_number(manifest.get("time")):
        raise corrupt(f"'time' must be a number, found {manifest.get('time')!r}")
    metric = manifest.get("metric")
    if metric is not None and (isinstance(metric, bool) or not isinstance(metric, (int, float))):
        raise corrupt(f"'metric' must be a number or null, found {manifest['metric']!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise corrupt(f"'files' must be a non-empty object, found {files!r}")
    for fname, entry in files.items():
        parts = fname.split("/")
        if not fname or fname.startswith("/") or ".." in parts or "" in parts or fname == MANIFEST:
            raise corrupt(f"file name {fname!r} is not a relative path inside the checkpoint")
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            raise corrupt(f"entry for {fname!r} must have exactly 'size' and 'sha256'")
        if not _is_int(entry["size"]) or entry["size"] < 0:
            raise corrupt(f"size of {fname!r} must be an integer >= 0, found {entry['size']!r}")
        digest = entry["sha256"]
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _SHA256_HEX:
            raise corrupt(f"sha256 of {fname!r} must be 64 lowercase hex digits")
    sharded = any(f.startswith(f"{SHARDED_DIR}/") for f in files)
    needed = [STATE_FILE] + ([] if sharded else ["model.safetensors", "optimizer.pt"])
    missing = [f for f in needed if f not in files]
    if missing:
        raise corrupt(f"it does not list {missing[0]!r}, which every checkpoint holds")
    return files


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- when: the policy --------------------------------------------------------------


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
        return bool(self.every) and step % self.every == 0  # type: ignore[operator]

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


# -- what: named state ------------------------------------------------------------


class RNGState:
    """Every RNG of this process (Python, NumPy, torch, CUDA), as a named state.

    ``per_rank``: each rank's own state is saved, so a resumed multi-rank run
    draws the same dropout masks on every rank.
    """

    per_rank = True

    def state_dict(self) -> dict[str, Any]:
        return _rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _set_rng_state(state)


class DictState:
    """A plain dict (``user_state``) as a named state: restored in place."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return self.data

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.clear()
        self.data.update(state)


class CallbackStates:
    """Stateful callbacks, keyed by name, as one named state.

    A saved state without a live callback, or a live one without saved state,
    is a warning (it starts fresh), or a :class:`CheckpointError` when ``strict``.
    """

    def __init__(self, callbacks: Mapping[str, Stateful], *, strict: bool = False) -> None:
        self.callbacks = callbacks
        self.strict = strict

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self.callbacks.items()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        problems = [
            f"saved state for callback {name!r} has no matching callback"
            for name in saved
            if name not in self.callbacks
        ]
        problems += [
            f"stateful callback {name!r} has no saved state (it starts fresh)"
            for name in self.callbacks
            if name not in saved
        ]
        if problems and self.strict:
            raise CheckpointError("callback state mismatch at resume: " + "; ".join(problems))
        for name, state in saved.items():
            if name in self.callbacks:
                self.callbacks[name].load_state_dict(state)
        for problem in problems:
            warnings.warn(f"hookloop resume: {problem}", stacklevel=4)


def save_state(
    state: Mapping[str, Stateful], staging: Path
) -> tuple[dict[str, bytes], list[Path]] | None:
    """Serialise ``state``; every rank calls it. Rank 0 gets the files to commit.

    Returns ``(files, written)`` on rank 0 (``written``: directories other ranks
    wrote into ``staging``, i.e. DCP shards) and None elsewhere. Every rank takes
    part: per-rank entries are gathered, and a sharded model is written by all.
    """
    model, optimizer = state[MODEL], state[OPTIMIZER]
    per_rank = {
        name: _gather_bytes(obj.state_dict())
        for name, obj in state.items()
        if getattr(obj, "per_rank", False)
    }
    written = []
    if is_sharded(model):
        save_sharded(model, optimizer, staging / SHARDED_DIR)  # type: ignore[arg-type]
        written.append(staging / SHARDED_DIR)
    if rank_info()[0] != 0:
        return None
    files = {} if written else _full_weights(model, optimizer, staging)  # type: ignore[arg-type]
    saved: dict[str, Any] = {}
    for name, obj in state.items():
        if name in (MODEL, OPTIMIZER):
            continue
        if name in per_rank:
            saved[name], saved[f"{name}_per_rank"] = per_rank[name][0], per_rank[name]
        else:
            saved[name] = _portable(obj.state_dict(), name)
    files[STATE_FILE] = _torch_bytes(saved)
    return files, written


def load_state(state: Mapping[str, Stateful], path: Path) -> None:
    """Restore ``state`` from the checkpoint directory ``path`` (verified by the caller).

    Entries the checkpoint does not hold (an older format, a scheduler added
    since) keep their current state.
    """
    model, optimizer = state[MODEL], state[OPTIMIZER]
    sharded_checkpoint = (path / SHARDED_DIR).is_dir()
    if is_sharded(model) != sharded_checkpoint:  # type: ignore[arg-type]
        saved, running = ("sharded", "full") if sharded_checkpoint else ("full", "sharded")
        raise CheckpointError(
            f"checkpoint {path} holds {saved} weights but this run's model is {running}: "
            "resume with the train.parallel and number of ranks it was saved with ('fsdp' "
            "with several ranks saves sharded weights, anything else full ones)"
        )
    if sharded_checkpoint:
        load_sharded(model, optimizer, path / SHARDED_DIR)  # type: ignore[arg-type]
    else:
        _load_full_weights(model, optimizer, path)  # type: ignore[arg-type]
    saved = _torch_load(path / STATE_FILE, torch.device("cpu"))
    rank, _, world_size = rank_info()
    for name, obj in state.items():
        if name in (MODEL, OPTIMIZER) or saved.get(name) is None:
            continue
        value = saved[name]
        if getattr(obj, "per_rank", False):
            value = _own_share(saved, name, rank, world_size)
        obj.load_state_dict(value)


def _own_share(saved: dict[str, Any], name: str, rank: int, world_size: int) -> Any:
    per_rank = saved.get(f"{name}_per_rank") or []
    if len(per_rank) == world_size and rank < len(per_rank):
        return per_rank[rank]
    if world_size > 1:
        warnings.warn(
            f"hookloop resume: checkpoint saved with {len(per_rank) or 1} rank(s), running "
            f"with {world_size}; every rank restores rank 0's {name} state",
            stacklevel=4,
        )
    return saved[name]


def _gather_bytes(value: Any) -> list[Any]:
    """Every rank's ``value`` (as bytes: object collectives do not carry tensors reliably)."""
    if not is_distributed():
        return [value]
    return [_torch_loads(b) for b in gather_objects(_torch_bytes(value))]


def _full_weights(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scratch_dir: Path
) -> dict[str, bytes]:
    from safetensors.torch import save_model

    tmp = scratch_dir.parent / f".model-{os.getpid()}.tmp"
    save_model(_unwrap(model), str(tmp))  # handles tied weights
    model_bytes = tmp.read_bytes()
    tmp.unlink()
    return {"model.safetensors": model_bytes, "optimizer.pt": _torch_bytes(optimizer.state_dict())}


def _load_full_weights(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path
) -> None:
    _load_safetensors(_unwrap(model), path / "model.safetensors")
    optimizer.load_state_dict(_torch_load(path / "optimizer.pt", _device_of(model)))


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank writes its shards of model and optimizer into ``directory`` (DCP, fsynced)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optim_state},
        storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
    )


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank reads its shards of model and optimizer from ``directory`` (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except dcp.CheckpointException as err:
        raise CheckpointError(
            f"{directory} does not fit the sharded model and optimizer: {err}"
        ) from None
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class SaveJob:
    """One captured save: stage, serialise, write and fsync, manifest, rename, ``latest``,
    retention. :meth:`run` is the whole commit protocol, the same whether it runs
    at once or on a writer thread (``checkpoint.async_save``)."""

    manager: CheckpointManager
    name: str
    state: Mapping[str, Stateful]
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
            raise ValueError(
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
        copy: Callable[[Mapping[str, Stateful]], Mapping[str, Stateful]] | None = None,
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
        if copy is not None:
            state = copy({**state, MODEL: _unwrap(state[MODEL])})  # type: ignore[dict-item]
        return SaveJob(self, f"step-{step:08d}", state, step, epoch, config, dict(metrics or {}))

    def _write(self, job: SaveJob) -> Path:
        """The commit protocol of one save (see :class:`SaveJob`)."""
        name = job.name
        rank_zero = rank_info()[0] == 0
        staging = self.storage.stage(name) if rank_zero else None
        if is_sharded(job.state[MODEL]):  # type: ignore[arg-type]
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
        state: Mapping[str, Stateful],
        staging: Path | None,
        step: int,
        epoch: int,
        config: dict[str, Any] | None,
        metrics: Mapping[str, Any] | None,
    ) -> Path:
        captured = save_state(state, staging or self.storage.root)
        path = self.storage.root / name
        if captured is not None:
            files, written = captured
            if config is not None:
                files["config.yaml"] = dump_yaml(config).encode()
            meta: dict[str, Any] = {"step": step, "epoch": epoch, "time": time.time()}
            if self.policy.monitor:
                meta["metric"] = _monitored(dict(metrics or {}), self.policy.monitor)
            entries: dict[str, dict[str, Any]] = {}
            for directory in written:  # DCP returns once every rank has written its shards
                entries.update(self.storage.entries_on_disk(staging, directory.name))  # type: ignore[arg-type]
            entries.update(self.storage.write(staging, files))  # type: ignore[arg-type]
            path = self.storage.publish(name, staging, entries, meta)  # type: ignore[arg-type]
            self._apply_retention()
        return path

    def _apply_retention(self) -> None:
        dirs = self.storage.complete()
        manifests = [{**_read_manifest_quiet(p), "name": p.name, "step": _step_of(p)} for p in dirs]
        keep = self.policy.to_keep(manifests, self.storage.latest_name())
        for p in dirs:
            if p.name not in keep:
                self.storage.delete(p)

    # -- resuming
    def find(self, target: str) -> Path | None:
        """The verified checkpoint ``target`` names: ``"auto"`` (newest intact, or None)
        or a path to a checkpoint, a checkpoints folder or a run directory."""
        if target == "auto":
            path = self._newest_intact()
            if path is None:
                log.info(
                    "hookloop: no checkpoint to resume in %s; starting fresh", self.storage.root
                )
            return path
        path = resolve_checkpoint(target)
        self.storage.verify(path)  # raises CheckpointError naming the file and problem
        return path

    def load(self, target: str, state: Mapping[str, Stateful]) -> Path | None:
        """Restore ``state`` from ``target`` (see :meth:`find`); None if nothing to resume."""
        path = self.find(target)
        if path is not None:
            load_state(state, path)
            self.last_saved_step = _read_manifest_quiet(path).get("step")
        return path

    def _newest_intact(self) -> Path | None:
        """The newest checkpoint that verifies; older ones are tried in turn, each skip said.

        When checkpoints exist but none is intact, starting over would silently
        throw the run away: that raises, listing each and why, unless
        ``allow_restart`` (``--allow-restart``) says to start fresh.
        """
        damaged = []
        for path in reversed(self.storage.complete()):
            try:
                self.storage.verify(path)
                return path
            except CheckpointError as err:
                damaged.append(f"{path.name}: {err}")
                warnings.warn(  # once: a warning, not also a log line (it printed twice)
                    f"hookloop resume: skipping damaged checkpoint: {err}; trying an older one",
                    stacklevel=3,
                )
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


def resolve_checkpoint(target: str | Path) -> Path:
    """A checkpoint directory from a checkpoint, a checkpoints folder (its ``latest``) or a
    run directory (its ``checkpoints/latest``)."""
    path = Path(target)
    for root in (path, path / CHECKPOINTS_DIR):
        pointer = root / LATEST
        if root.is_dir() and pointer.is_file():
            return root / pointer.read_text().strip()
    return path


# -- weights only (finetuning) ------------------------------------------------------


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load model weights from a ``.safetensors`` file or a checkpoint directory.

    A checkpoint directory (or a checkpoints folder or run directory, whose
    ``latest`` is taken) holds either ``model.safetensors`` or, from an FSDP2
    run, DCP shards under ``sharded/``; either loads into a plain or a sharded
    model (with several ranks, call it on every rank). Tied weights (a GPT's
    shared embedding and output matrix) are stored once and restored under
    both names. A mismatch raises :class:`CheckpointError` (a ``ValueError``).
    """
    path = Path(path)
    if path.is_dir():
        path = _weights_in(resolve_checkpoint(path), path)
    if not path.exists():
        raise FileNotFoundError(f"pretrained weights not found: {path}")
    if path.is_dir():  # DCP shards
        _load_dcp_weights(model, path)
    elif is_sharded(model):
        _load_full_into_sharded(model, path)
    else:
        _load_safetensors(model, path)


def _weights_in(checkpoint: Path, given: Path) -> Path:
    for candidate in (checkpoint / "model.safetensors", checkpoint / SHARDED_DIR):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"no model.safetensors or {SHARDED_DIR}/ (FSDP2 shards) in checkpoint directory "
        f"{given} or its latest checkpoint"
    )


def _load_dcp_weights(model: torch.nn.Module, shards: Path) -> None:
    """Read the model part of a DCP checkpoint, resharding to however ``model`` is laid out."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: we asked it to
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(
                state, storage_reader=dcp.FileSystemReader(shards), no_dist=not is_distributed()
            )
    except dcp.CheckpointException as err:
        raise CheckpointError(f"weights in {shards} do not fit the model: {err}") from None
    set_model_state_dict(model, state["model"])


def _load_full_into_sharded(model: torch.nn.Module, path: Path) -> None:
    """Every rank reads the whole file and keeps its own slice of each weight."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = load_file(str(path))
    names = dict(model.named_parameters(remove_duplicate=False))
    for name, param in names.items():  # a tied weight is stored under one of its names
        if name not in full:
            alias = next((n for n, p in names.items() if p is param and n in full), None)
            if alias is not None:
                full[name] = full[alias]
    result = set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    _check_fit(path, result.missing_keys, result.unexpected_keys)


def _load_safetensors(model: torch.nn.Module, path: Path) -> None:
    """Load a safetensors file into a plain model (tied weights are stored once)."""
    from safetensors.torch import load_model

    try:
        missing, unexpected = load_model(
            model, str(path), strict=False, device=str(_device_of(model))
        )
    except RuntimeError as err:  # a shape mismatch: name the file, keep torch's details, one line
        details = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
        raise CheckpointError(
            f"weights in {path} do not fit the model: {'; '.join(details) or err}"
        ) from None
    _check_fit(path, missing, unexpected)


def _check_fit(path: Path, missing: Any, unexpected: Any) -> None:
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {path} do not fit the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# -- helpers --------------------------------------------------------------------


def _monitored(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _portable(value: Any, what: str) -> Any:
    """Check that ``value`` reloads with ``weights_only=True``; raise naming ``what`` if not.

    When a dict fails, the first entry that fails is named (``callbacks['Patience']``).
    """
    try:
        _torch_loads(_torch_bytes(value))
    except Exception as err:
        if isinstance(value, dict):
            for key, item in value.items():
                _portable(item, f"{what}[{key!r}]")
        raise CheckpointError(
            f"{what} cannot be checkpointed safely: it must hold only tensors, numbers, "
            f"strings, bools, None, lists, tuples and dicts ({err})"
        ) from None
    return value


def _torch_bytes(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _torch_loads(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def _torch_load(path: Path, device: torch.device) -> Any:
    return torch.load(path, map_location=device, weights_only=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest_quiet(path: Path) -> dict[str, Any]:
    """The manifest's fields, or {} when it is unreadable (used for ordering, never trust)."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _step_of(path: Path) -> int:
    step = _read_manifest_quiet(path).get("step")
    return step if _is_int(step) else -1


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(point: str, step: int | None) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    if spec in (point, f"{point}@{step}"):
        os._exit(86)
    if point == FAULT_POINTS[0] and spec in ("enospc", f"enospc@{step}"):
        raise OSError(errno.ENOSPC, f"No space left on device ({FAULT_ENV}={spec})")
