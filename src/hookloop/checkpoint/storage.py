"""Where checkpoints live: atomic, verified directories under one root.

A save stages its files in a fresh directory and fsyncs them; ``manifest.json``,
listing every file's size and SHA-256, is written last; the directory is renamed
into place; the ``latest`` pointer is replaced atomically. A directory without a
valid manifest is never loaded and is removed by the next save. The manifest's
schema is checked field by field (:func:`check_manifest`) before anything in it is
trusted.

A checkpoint's identity is checked, so that one flipped bit cannot reorder a run's
history: the manifest carries a SHA-256 of its own fields (format 2), its name and
step must be those of the directory it lies in, and checkpoints are ordered by the
step in their directory names (which only the commit's rename sets), never by what a
manifest says. The checksums are unkeyed: they detect accidents (a flipped bit, a
torn write, a file changed by mistake), not someone who rewrites a file and its
manifest; identity comes from the directory's name and the step saved in it.

Format 3 checkpoints also hold the live ``set`` changes (``trainer_state.pt``'s
``settings`` entry); format 4 ones may hold callbacks' sharded state (``EMA``'s averages
under FSDP2) beside the model's in ``sharded/``. Formats 3, 2 and 1 (no checksum) are
still read: as checkpoints without callbacks' shards, and (2 and 1) of runs nobody steered.

``HOOKLOOP_CHECKPOINT_FAULT`` (:data:`FAULT_ENV`) makes the process die, or a save
fail as a full disk would, at a named point of this protocol: the crash tests use it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, TypeGuard

from hookloop.errors import ConfigError
from hookloop.rundir import CHECKPOINTS_DIR

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 4
#: Formats this hookloop reads: 1 (before the manifest carried its own checksum), 2
#: (before checkpoints held the live settings), 3 (before a sharded checkpoint held
#: callbacks' shards) and 4.
READABLE_FORMATS = (1, 2, 3, 4)
#: A checkpoint directory's name: the step it holds, zero-padded.
_STEP_NAME = re.compile(r"step-(\d+)")
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


class CheckpointError(RuntimeError, ConfigError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, or not this model's
    (a :class:`~hookloop.errors.ConfigError`: the command line names a checkpoint to refuse)."""


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
            write_synced(staging / fname, data)
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
        manifest["checksum"] = manifest_checksum(manifest)
        write_synced(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync(staging)
        _fault("manifest_written", meta.get("step"))
        final = self.root / name
        if final.exists():  # same step saved again (e.g. on request, then at the end)
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync(self.root)
        _fault("renamed", meta.get("step"))
        pointer = self.root / f".{LATEST}.tmp"
        write_synced(pointer, name.encode())
        _fault("latest_staged", meta.get("step"))
        os.replace(pointer, self.root / LATEST)
        _fsync(self.root)
        _fault("committed", meta.get("step"))
        return final

    def complete(self) -> list[Path]:
        """Checkpoint directories that have a manifest, oldest first (by the step in their
        names: see :func:`step_of`)."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()
        ]
        return sorted(found, key=lambda p: (step_of(p), p.name))

    def latest_name(self) -> str | None:
        """The checkpoint ``latest`` names; None when there is no pointer or it is unreadable."""
        pointer = self.root / LATEST
        try:
            return pointer.read_text().strip() or None if pointer.is_file() else None
        except (OSError, UnicodeDecodeError):
            return None

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
        try:  # a JSON object: check_manifest below refuses anything else
            manifest: dict[str, Any] = json.loads(manifest_path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise CheckpointError(f"{manifest_path} is corrupt: not valid JSON ({err})") from None
        files = check_manifest(manifest, manifest_path)
        check_identity(manifest, path)
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


_MANIFEST_KEYS = {"format", "name", "step", "epoch", "time", "metric", "files", "checksum"}
_SHA256_HEX = frozenset("0123456789abcdef")


def check_manifest(manifest: Any, where: Path) -> dict[str, dict[str, Any]]:
    """Validate a manifest against its schema; return its ``files`` table.

    Every field is checked for presence, type and range; unknown fields and
    format versions are refused; the files a checkpoint needs must be listed; a
    format 2 manifest must match its own checksum. A violation raises
    :class:`CheckpointError` naming ``where`` and the reason.
    """
    if not isinstance(manifest, dict):
        raise _corrupt(where, f"expected a JSON object, found {type(manifest).__name__}")
    _check_format(manifest, where)
    _check_identity_fields(manifest, where)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise _corrupt(where, f"'files' must be a non-empty object, found {files!r}")
    for fname, entry in files.items():
        _check_file_entry(fname, entry, where)
    sharded = any(f.startswith(f"{SHARDED_DIR}/") for f in files)
    needed = [STATE_FILE] + ([] if sharded else ["model.safetensors", "optimizer.pt"])
    missing = [f for f in needed if f not in files]
    if missing:
        raise _corrupt(where, f"it does not list {missing[0]!r}, which every checkpoint holds")
    return files


def _corrupt(where: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{where} is corrupt: {reason}")


def _check_format(manifest: dict[str, Any], where: Path) -> None:
    """Known fields only, a format this hookloop reads, and (format 2 on) a checksum that
    matches: checked first, since nothing else in an altered manifest can be trusted."""
    unknown = sorted(set(manifest) - _MANIFEST_KEYS)
    if unknown:
        allowed = ", ".join(sorted(_MANIFEST_KEYS))
        raise _corrupt(where, f"unknown field {unknown[0]!r} (allowed: {allowed})")
    version = manifest.get("format")
    if not _is_int(version):
        raise _corrupt(where, f"'format' must be an integer, found {version!r}")
    if version not in READABLE_FORMATS:
        raise _corrupt(
            where,
            f"format version {version} is not one this hookloop reads "
            f"({', '.join(map(str, READABLE_FORMATS))}); was it written by a newer hookloop?",
        )
    if version >= 2 and manifest.get("checksum") != manifest_checksum(manifest):
        raise _corrupt(
            where,
            "its checksum does not match its fields (the manifest was altered since it was "
            "saved; its step, name or file list cannot be trusted)",
        )
    if version < 2 and "checksum" in manifest:
        raise _corrupt(where, "unknown field 'checksum' in a format 1 manifest")


def _check_identity_fields(manifest: dict[str, Any], where: Path) -> None:
    """What the checkpoint is: its name, step, epoch, time and metric, each of its type."""
    if not isinstance(manifest.get("name"), str) or not manifest["name"]:
        raise _corrupt(where, f"'name' must be a non-empty string, found {manifest.get('name')!r}")
    for key in ("step", "epoch"):
        if not _is_int(manifest.get(key)) or manifest[key] < 0:
            raise _corrupt(where, f"{key!r} must be an integer >= 0, found {manifest.get(key)!r}")
    if not _is_number(manifest.get("time")):
        raise _corrupt(where, f"'time' must be a number, found {manifest.get('time')!r}")
    metric = manifest.get("metric")
    if metric is not None and (isinstance(metric, bool) or not isinstance(metric, (int, float))):
        raise _corrupt(where, f"'metric' must be a number or null, found {metric!r}")


def _check_file_entry(fname: str, entry: Any, where: Path) -> None:
    """One row of the ``files`` table: a relative path inside the checkpoint (never the
    manifest itself), with exactly a size and a SHA-256."""
    parts = fname.split("/")
    if not fname or fname.startswith("/") or ".." in parts or "" in parts or fname == MANIFEST:
        raise _corrupt(where, f"file name {fname!r} is not a relative path inside the checkpoint")
    if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
        raise _corrupt(where, f"entry for {fname!r} must have exactly 'size' and 'sha256'")
    if not _is_int(entry["size"]) or entry["size"] < 0:
        raise _corrupt(where, f"size of {fname!r} must be an integer >= 0, found {entry['size']!r}")
    digest = entry["sha256"]
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _SHA256_HEX:
        raise _corrupt(where, f"sha256 of {fname!r} must be 64 lowercase hex digits")


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of every field of ``manifest`` but ``checksum``, as canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_identity(manifest: dict[str, Any], path: Path) -> None:
    """The manifest describes the directory it lies in: the same name, and the step in that
    name. Raises :class:`CheckpointError` otherwise (a manifest copied, renamed or altered)."""
    where = path / MANIFEST
    if manifest["name"] != path.name:
        raise CheckpointError(
            f"{where} is corrupt: it names checkpoint {manifest['name']!r} but lies in "
            f"{path.name!r}"
        )
    named = _STEP_NAME.fullmatch(path.name)
    if named is not None and manifest["step"] != int(named.group(1)):
        raise CheckpointError(
            f"{where} is corrupt: it says step {manifest['step']} but the directory holds "
            f"step {int(named.group(1))}"
        )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest's fields, or {} when it is unreadable (used for ordering, never trust)."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def step_of(path: Path) -> int:
    """The step checkpoint ``path`` holds: the number in its name (``step-00000030``), which
    the commit's rename set and no damage to its manifest can change; for a directory named
    otherwise, its manifest's step (-1 when unreadable)."""
    named = _STEP_NAME.fullmatch(path.name)
    if named is not None:
        return int(named.group(1))
    step = read_manifest(path).get("step")
    return step if _is_int(step) else -1


def write_synced(path: Path, data: bytes) -> None:
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


def resolve_checkpoint(target: str | Path) -> Path:
    """A checkpoint directory from a checkpoint, a checkpoints folder (its ``latest``) or a
    run directory (its ``checkpoints/latest``).

    A ``latest`` that is empty or names something other than a checkpoint beside it is
    refused by name (:class:`CheckpointError`), not followed.
    """
    path = Path(target)
    for root in (path, path / CHECKPOINTS_DIR):
        pointer = root / LATEST
        if root.is_dir() and pointer.is_file():
            try:
                name = pointer.read_text().strip()
            except UnicodeDecodeError:
                name = "\0"
            if not name or "/" in name or "\0" in name or name in (".", ".."):
                what = "is empty" if not name else "does not name a checkpoint directory"
                raise CheckpointError(
                    f"{pointer} {what} (damaged, or a save interrupted while writing it); "
                    "resume with --resume auto, which picks the newest intact checkpoint "
                    f"in {root}, or name one of its step-* directories"
                )
            return root / name
    return path
