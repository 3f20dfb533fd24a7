"""Checkpoints: what is saved, where it is written, and when.

- *What* (:func:`capture` / :func:`restore`): model weights (safetensors),
  optimizer, scheduler, grad scaler, every RNG, the data position, the train
  state, ``user_state``, each stateful callback keyed by name, and the config.
- *Where* (:class:`CheckpointStorage`): an atomic commit. Files go into a
  staging directory and are fsynced; ``manifest.json`` with every file's size
  and SHA-256 is written last; the directory is renamed into place; the
  ``latest`` pointer is replaced atomically. A directory without a valid
  manifest is never loaded and is removed by the next save.
- *When* (:class:`SavePolicy`): every N steps, at the end, on stop and
  signal (not abort), on request; keep the last K and the best K by a metric.

:class:`CheckpointManager` joins the three for a Trainer.

Layout under ``<out_dir>/checkpoints/``::

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

import hashlib
import json
import logging
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

from hookloop.distributed import barrier, broadcast_object, gather_objects, is_sharded

if TYPE_CHECKING:
    from hookloop.trainer import Trainer

log = logging.getLogger("hookloop.checkpoint")

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1
#: Crash-safety testing: ``POINT`` or ``POINT@STEP`` makes the process die (``os._exit``)
#: at that point of the save protocol (at the save of checkpoint STEP, if given).
FAULT_ENV = "HOOKLOOP_CHECKPOINT_FAULT"
FAULT_POINTS = ("files_written", "manifest_written", "renamed", "latest_staged", "committed")
#: Subdirectory of a checkpoint holding a sharded model and optimizer (DCP format).
SHARDED_DIR = "sharded"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, or corrupted."""


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
        return sorted(found, key=lambda p: (_read_manifest_quiet(p).get("step", -1), p.name))

    def latest_name(self) -> str | None:
        pointer = self.root / LATEST
        return pointer.read_text().strip() if pointer.is_file() else None

    def verify(self, path: str | Path) -> dict[str, Any]:
        """Return the manifest if every file is present and intact, else raise CheckpointError."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(
                f"checkpoint {path} has no {MANIFEST}: it was never completed (torn save)"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{manifest_path} is unreadable: {err}") from None
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


# -- what: capturing and restoring a trainer -------------------------------------


def capture(
    trainer: Trainer, rng_per_rank: list[dict[str, Any]] | None = None
) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Serialise everything needed to continue ``trainer`` exactly; return files and meta.

    ``rng_per_rank`` holds every rank's RNG states (gathered by the caller), so a
    resumed multi-rank run draws the same dropout masks on every rank. A sharded
    model's weights and optimizer are not among the files: every rank writes its
    shards with :func:`save_sharded`.
    """
    st = trainer.state
    files = {} if is_sharded(trainer.model) else _full_weights(trainer)
    state = {
        "train_state": st.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "rng": rng_per_rank[0] if rng_per_rank else _rng_state(),
        "rng_per_rank": rng_per_rank or [],
        "data": _data_state(trainer),
        "user_state": _portable(trainer.callbacks.user_state, "user_state"),
        "callbacks": {
            name: _portable(cb.state_dict(), f"callback {name!r}")
            for name, cb in trainer.callbacks.stateful_callbacks().items()
        },
        "log_pending": trainer._log_losses,
    }
    files["trainer_state.pt"] = _torch_bytes(state)
    files["config.yaml"] = yaml.safe_dump(trainer.config.to_dict(), sort_keys=False).encode()
    meta = {"step": st.step, "epoch": st.epoch, "time": time.time()}
    return files, meta


def _full_weights(trainer: Trainer) -> dict[str, bytes]:
    from safetensors.torch import save_model

    tmp = _scratch_file(trainer)
    save_model(_unwrap(trainer.model), str(tmp))  # handles tied weights
    model_bytes = tmp.read_bytes()
    tmp.unlink()
    return {
        "model.safetensors": model_bytes,
        "optimizer.pt": _torch_bytes(trainer.optimizer.state_dict()),
    }


def save_sharded(trainer: Trainer, directory: Path) -> None:
    """Every rank writes its shards of model and optimizer into ``directory`` (DCP, fsynced)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optim_state},
        storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
    )


def load_sharded(trainer: Trainer, directory: Path) -> None:
    """Every rank reads its shards of model and optimizer from ``directory`` (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except dcp.CheckpointException as err:
        raise CheckpointError(
            f"{directory} does not fit the sharded model and optimizer: {err}"
        ) from None
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def restore(trainer: Trainer, path: Path, *, strict: bool = False) -> None:
    """Load a verified checkpoint directory into ``trainer``."""
    sharded_checkpoint = (path / SHARDED_DIR).is_dir()
    if is_sharded(trainer.model) != sharded_checkpoint:
        saved, running = ("sharded", "full") if sharded_checkpoint else ("full", "sharded")
        raise CheckpointError(
            f"checkpoint {path} holds {saved} weights but this run's model is {running}: "
            "resume with the train.parallel and number of ranks it was saved with ('fsdp' "
            "with several ranks saves sharded weights, anything else full ones)"
        )
    if sharded_checkpoint:
        load_sharded(trainer, path / SHARDED_DIR)
    else:
        _load_full_weights(trainer, path)
    state = _torch_load(path / "trainer_state.pt", torch.device("cpu"))
    trainer.state.load_state_dict(state["train_state"])
    if trainer.scheduler is not None and state["scheduler"] is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler is not None and state["scaler"] is not None:
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.callbacks.user_state.clear()
    trainer.callbacks.user_state.update(state["user_state"])
    _restore_callbacks(trainer, state["callbacks"], strict=strict)
    _restore_data(trainer, state["data"])
    trainer._log_losses = [
        {k: v.to(trainer.device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
        for d in state.get("log_pending", [])
    ]
    per_rank = state.get("rng_per_rank") or []
    rank = trainer.state.rank
    if len(per_rank) == trainer.state.world_size and rank < len(per_rank):
        _set_rng_state(per_rank[rank])
    else:
        if trainer.state.world_size > 1:
            warnings.warn(
                f"hookloop resume: checkpoint saved with {len(per_rank) or 1} rank(s), running "
                f"with {trainer.state.world_size}; every rank restores rank 0's RNG state",
                stacklevel=3,
            )
        _set_rng_state(state["rng"])


def _load_full_weights(trainer: Trainer, path: Path) -> None:
    from safetensors.torch import load_model

    missing, unexpected = load_model(
        _unwrap(trainer.model),
        str(path / "model.safetensors"),
        strict=False,
        device=str(trainer.device),
    )
    if missing or unexpected:
        raise CheckpointError(
            f"{path / 'model.safetensors'} does not fit the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    trainer.optimizer.load_state_dict(_torch_load(path / "optimizer.pt", trainer.device))


def _restore_callbacks(trainer: Trainer, saved: dict[str, Any], *, strict: bool) -> None:
    live = trainer.callbacks.stateful_callbacks()
    problems = []
    for name, cb_state in saved.items():
        if name in live:
            live[name].load_state_dict(cb_state)
        else:
            problems.append(f"saved state for callback {name!r} has no matching callback")
    problems += [
        f"stateful callback {name!r} has no saved state (it starts fresh)"
        for name in live
        if name not in saved
    ]
    if problems and strict:
        raise CheckpointError("callback state mismatch at resume: " + "; ".join(problems))
    for problem in problems:
        warnings.warn(f"hookloop resume: {problem}", stacklevel=3)


def _data_state(trainer: Trainer) -> dict[str, Any]:
    loader = trainer.train_loader
    if hasattr(loader, "state_dict") and callable(loader.state_dict):
        return {"loader": loader.state_dict()}
    return {}


def _restore_data(trainer: Trainer, data: dict[str, Any]) -> None:
    loader = trainer.train_loader
    if "loader" in data and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(data["loader"])
        trainer._loader_positioned = True


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


# -- the manager: policy + storage for one Trainer ------------------------------------


class CheckpointManager:
    """Saves and resumes one Trainer's checkpoints under ``<out_dir>/checkpoints``."""

    def __init__(self, trainer: Trainer, root: Path, policy: SavePolicy) -> None:
        self.trainer = trainer
        self.storage = CheckpointStorage(root)
        self.policy = policy
        self.strict = trainer.config.checkpoint.strict_resume
        self.last_saved_step: int | None = None

    @classmethod
    def for_trainer(cls, trainer: Trainer) -> CheckpointManager:
        c = trainer.config.checkpoint
        policy = SavePolicy(c.every, c.keep_last, c.save_on_end, c.monitor, c.mode, c.keep_best)
        base = Path(trainer.out_dir) if trainer.out_dir is not None else None
        if base is None:  # resume from a path without out_dir: save next to it
            resume = Path(str(trainer.resume))
            base = resume.parent.parent if resume.parent.name == "checkpoints" else resume.parent
        manager = cls(trainer, base / "checkpoints", policy)
        if trainer.resume is None and manager.storage.complete():
            raise ValueError(
                f"{manager.storage.root} already holds checkpoints of a run; continue it with "
                "resume='auto' (CLI: --resume auto) or choose another output directory"
            )
        return manager

    # -- saving
    def maybe_save(self, *, requested: bool = False) -> Path | None:
        """At a step boundary: save if the interval is due or a save was requested."""
        if requested or self.policy.due(self.trainer.state.step):
            return self.save()
        return None

    def save_final(self) -> Path | None:
        """At the end of training: always after a stop or signal, else if save_on_end."""
        reason = self.trainer.state.stop_reason or ""
        stopped = reason not in ("max_steps", "max_epochs", "finished", "")
        if stopped or self.policy.save_on_end:
            return self.save()
        return None

    def save(self) -> Path | None:
        trainer, st = self.trainer, self.trainer.state
        if self.last_saved_step == st.step:
            return None  # this exact state is already on disk
        self.last_saved_step = st.step
        trainer.sync_counters()
        # Every rank takes part: RNG states are gathered, rank 0 writes, all wait for it.
        rng_per_rank = None
        if st.world_size > 1:  # as bytes: object collectives do not carry tensors reliably
            rng_per_rank = [_torch_loads(b) for b in gather_objects(_torch_bytes(_rng_state()))]
        name = f"step-{st.step:08d}"
        staging = None
        if is_sharded(trainer.model):  # every rank writes its shards into rank 0's staging dir
            staging = Path(
                broadcast_object(str(self.storage.stage(name)) if st.is_rank_zero else "")
            )
            save_sharded(trainer, staging / SHARDED_DIR)
        path = self.storage.root / name
        if st.is_rank_zero:
            files, meta = capture(trainer, rng_per_rank)
            if self.policy.monitor:
                meta["metric"] = _monitored(st.last_eval, self.policy.monitor)
            if staging is None:
                path = self.storage.commit(name, files, meta)
            else:  # the shards are complete: DCP returns once every rank has written
                entries = self.storage.entries_on_disk(staging, SHARDED_DIR)
                entries.update(self.storage.write(staging, files))
                path = self.storage.publish(name, staging, entries, meta)
            self._apply_retention()
        barrier()
        trainer.ctx.checkpoint_path = path
        trainer._fire("on_checkpoint_save")
        trainer.ctx.checkpoint_path = None
        return path

    def _apply_retention(self) -> None:
        dirs = self.storage.complete()
        manifests = [{**_read_manifest_quiet(p), "name": p.name} for p in dirs]
        keep = self.policy.to_keep(manifests, self.storage.latest_name())
        for p in dirs:
            if p.name not in keep:
                self.storage.delete(p)

    # -- resuming
    def resume(self, target: str) -> Path | None:
        """Restore from ``"auto"`` (newest intact checkpoint) or an explicit path."""
        if target == "auto":
            path = self._newest_intact()
            if path is None:
                log.info(
                    "hookloop: no checkpoint to resume in %s; starting fresh", self.storage.root
                )
                return None
        else:
            path = Path(target)
            if path.is_dir() and (path / LATEST).is_file():  # a checkpoints root
                path = path / (path / LATEST).read_text().strip()
            elif path.is_dir() and (path / "checkpoints" / LATEST).is_file():  # a run dir
                root = path / "checkpoints"
                path = root / (root / LATEST).read_text().strip()
            self.storage.verify(path)  # raises CheckpointError naming the file and problem
        restore(self.trainer, path, strict=self.strict)
        self.last_saved_step = self.trainer.state.step
        self.trainer.ctx.checkpoint_path = path
        self.trainer._fire("on_checkpoint_load")
        self.trainer.ctx.checkpoint_path = None
        return path

    def _newest_intact(self) -> Path | None:
        for path in reversed(self.storage.complete()):
            try:
                self.storage.verify(path)
                return path
            except CheckpointError as err:
                msg = f"hookloop resume: skipping damaged checkpoint: {err}; trying an older one"
                log.warning(msg)
                warnings.warn(msg, stacklevel=3)
        return None


# -- helpers --------------------------------------------------------------------


def _monitored(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _portable(value: Any, what: str) -> Any:
    """Check that ``value`` reloads with ``weights_only=True``; raise naming ``what`` if not."""
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as err:
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


def _scratch_file(trainer: Trainer) -> Path:
    root = Path(trainer.checkpoints.storage.root)
    root.mkdir(parents=True, exist_ok=True)
    return root / f".model-{os.getpid()}.tmp"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest_quiet(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


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
    if spec and spec in (point, f"{point}@{step}"):
        os._exit(86)
