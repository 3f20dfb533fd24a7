"""HF's checkpoint layout for the dialect: ``output_dir/checkpoint-N/``.

hookloop's checkpoints stay where and as the engine writes them (atomic,
checksummed, under ``output_dir/checkpoints/``); beside them each save gets HF's
folder ``checkpoint-N``, a complete checkpoint both ways:

- every file of the hookloop checkpoint (``manifest.json``, ``model.safetensors``,
  ``optimizer.pt``, ``trainer_state.pt``, ``config.yaml``), copied, so a copy of the
  folder (``cp -r``, ``cp -rL``) resumes on its own, exactly. Copied, not hard-linked:
  transformers and the scripts written for it rewrite files of the folder in place
  (``torch.save(..., "optimizer.pt")`` opens the path with ``"wb"``), and through a
  hard link each such write would change hookloop's checkpoint too. Where the file
  system shares blocks between copies (btrfs, XFS: ``copy_file_range`` makes a
  reflink) a copy costs no space until one side is written; elsewhere it costs the
  checkpoint's size once more;
- what transformers writes beside them (``config.json``, ``generation_config.json``,
  the tokenizer's files, ``scheduler.pt``, ``rng_state.pth``, ``training_args.bin``,
  ``trainer_state.json``): ``from_pretrained`` loads the folder and
  ``transformers.Trainer`` resumes from it (``model.safetensors`` and
  ``optimizer.pt`` are in both formats at once);
- ``step-N``, a relative link to the hookloop checkpoint, named as it: a folder
  whose checkpoint was rotated away is removed with it, and a ``cp -rL`` copy holds
  that checkpoint under its own name (folders written before name it ``.hookloop``).
  The folder's own ``manifest.json`` names the folder, and its checksum is computed
  again (a checksum: it catches a damaged file, not a deliberate rewrite).

The folder is built under a temporary name and renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookloop.checkpoint import MANIFEST, SavePolicy
from hookloop.checkpoint.storage import manifest_checksum, write_synced
from hookloop.compat.hf import console

TRAINER_STATE_NAME = "trainer_state.json"
LINK = ".hookloop"


def hf_folder(output_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def write(
    output_dir: str | os.PathLike[str],
    step: int,
    native: Path,
    state: Any,
    extras: Callable[[Path], None] | None = None,
) -> Path:
    """HF's folder for the checkpoint ``native`` of ``step`` (see the module doc);
    ``extras(folder)`` writes transformers' own files into it. Returns the folder."""
    folder = hf_folder(output_dir, step)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for entry in Path(native).iterdir():
        if entry.is_file() and entry.name != MANIFEST:
            _copy(entry, partial / entry.name)
    if extras is not None:
        console.announce_saving(folder)  # as transformers, naming the folder being made
        with console.naming_final_folder(partial, folder):
            extras(partial)
    state.save_to_json(partial / TRAINER_STATE_NAME)
    # The folder's own manifest lists transformers' files too, so the folder (or a copy)
    # passes hookloop's check of a checkpoint: nothing unlisted, every file intact.
    # It names the folder it lies in (its checksum computed again), as hookloop checks it.
    manifest = json.loads((Path(native) / MANIFEST).read_text(encoding="utf-8"))
    for entry in sorted(partial.iterdir()):
        if entry.is_file() and entry.name not in manifest["files"]:
            manifest["files"][entry.name] = {"size": entry.stat().st_size, "sha256": _sha256(entry)}
    manifest["name"] = folder.name
    if manifest.get("format", 1) >= 2:
        manifest["checksum"] = manifest_checksum(manifest)
    write_synced(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
    # The link is named as the checkpoint it points to, so a copy that follows it
    # (cp -rL) holds that checkpoint under its own name.
    link = partial / Path(native).name
    link.symlink_to(os.path.relpath(native, folder), target_is_directory=True)
    if folder.exists() or folder.is_symlink():
        shutil.rmtree(folder)
    os.replace(partial, folder)
    _prune(Path(output_dir))
    return folder


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy(source: Path, target: Path) -> None:
    """Copy ``source`` to a new ``target``, synced: the folder is as durable as the
    checkpoint it copies."""
    with open(source, "rb") as src, open(target, "xb") as dst:
        if not _copy_in_kernel(src.fileno(), dst.fileno()):
            src.seek(0)
            dst.seek(0)
            dst.truncate()
            shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    shutil.copystat(source, target)


def _copy_in_kernel(src: int, dst: int) -> bool:
    """Copy all of ``src`` into ``dst`` with ``copy_file_range`` (a reflink on btrfs and
    XFS); False where it is not available (not Linux, across file systems on old kernels)."""
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is None:
        return False
    left = os.fstat(src).st_size
    try:
        while left > 0:
            done = copy_range(src, dst, left)
            if done == 0:
                break
            left -= done
    except OSError:
        return False
    return True


def _link_of(folder: Path) -> Path | None:
    """The entry of an HF folder that links to (or, copied with -L, holds) its hookloop
    checkpoint: named ``step-N`` (``.hookloop`` in folders written before)."""
    for entry in (*folder.glob("step-*"), folder / LINK):
        if entry.is_symlink() or entry.is_dir():
            return entry
    return None


def _prune(output_dir: Path) -> None:
    """Remove HF folders whose hookloop checkpoint was rotated away."""
    for folder in output_dir.glob("checkpoint-*"):
        link = _link_of(folder)
        if link is not None and link.is_symlink() and not link.exists():
            shutil.rmtree(folder, ignore_errors=True)


def keep_only(output_dir: str | os.PathLike[str], best: Path) -> None:
    """Remove every ``checkpoint-N`` folder of ``output_dir`` but ``best`` (nothing when
    ``best`` is gone): those whose hookloop checkpoint the retention removed go silently,
    as transformers' rotation removed them in training; the others in step order, each
    announced as transformers announces it."""
    if not best.is_dir():
        return
    _prune(Path(output_dir))
    for _, folder in _numbered(Path(output_dir)):
        if not os.path.samefile(folder, best):
            console.announce_deleting(folder)
            shutil.rmtree(folder, ignore_errors=True)


def _numbered(output_dir: Path) -> list[tuple[int, Path]]:
    """``(N, folder)`` of each ``checkpoint-N`` folder of ``output_dir``, by N."""
    found = []
    for folder in output_dir.glob("checkpoint-*"):
        number = folder.name.removeprefix("checkpoint-")
        if number.isdigit() and folder.is_dir():
            found.append((int(number), folder))
    return sorted(found)


def last_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The ``checkpoint-N`` folder of ``output_dir`` with the highest N (None: none), as
    transformers' ``get_last_checkpoint`` finds it."""
    found = _numbered(Path(output_dir))
    return found[-1][1] if found else None


def written_by_transformers(path: str | os.PathLike[str]) -> bool:
    """A folder with transformers' ``trainer_state.json`` and no hookloop manifest."""
    folder = Path(path)
    return (folder / TRAINER_STATE_NAME).is_file() and not (folder / MANIFEST).is_file()


def native_checkpoint(path: str | os.PathLike[str]) -> str:
    """The hookloop checkpoint behind an HF folder: the one its link names while that
    exists (or the copy of it a ``cp -rL`` made), else the folder itself (a copy holds
    every file of it, listed in its own manifest); any other path as given."""
    link = _link_of(Path(path))
    if link is None:
        return str(path)
    if link.is_symlink() and link.exists():
        return str(link.resolve())
    if link.is_dir() and (link / MANIFEST).is_file():  # copied with its link followed (cp -rL)
        return str(link)
    return str(path)


@dataclasses.dataclass
class HFRetention(SavePolicy):
    """HF's ``save_total_limit``: the newest ``keep_last`` checkpoints, the best one
    counted among them (moved up to second newest when older), and two when the limit is one and the
    best is not the newest. The best is HF's ``best_model_checkpoint`` at the time:
    the checkpoint of ``best_step()`` (the best evaluation's step) when one was saved."""

    best_step: Callable[[], int | None] = lambda: None

    def to_keep(self, manifests: list[dict[str, Any]], latest: str | None) -> set[str]:
        if self.keep_last is None:
            return {m["name"] for m in manifests}
        names = [m["name"] for m in sorted(manifests, key=lambda m: m.get("step", -1))]
        step = self.best_step()
        best = next((m["name"] for m in manifests if step and m.get("step") == step), None)
        limit = self.keep_last
        if best is not None:
            if names.index(best) < len(names) - 2:  # up to second newest, never down
                names.remove(best)
                names.insert(len(names) - 1, best)
            if limit == 1 and names[-1] != best:
                limit = 2
        keep = set(names[-limit:])
        if latest:
            keep.add(latest)
        return keep
