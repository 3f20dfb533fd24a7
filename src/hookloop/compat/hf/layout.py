"""HF's checkpoint layout for the dialect: ``output_dir/checkpoint-N/trainer_state.json``.

hookloop's checkpoints stay where and as the engine writes them (atomic,
checksummed, under ``output_dir/checkpoints/``); beside them each save gets
HF's folder ``checkpoint-N`` holding ``trainer_state.json`` (HF's
``TrainerState``, stateful callbacks included), a relative link to each file of
the hookloop checkpoint (``model.safetensors``, ...) and one, ``.hookloop``, to
the checkpoint itself. HF code that resumes from ``output_dir/checkpoint-N`` or
reads its files finds them.
A folder whose checkpoint was rotated away is removed with it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from hookloop.checkpoint import SavePolicy

TRAINER_STATE_NAME = "trainer_state.json"
LINK = ".hookloop"


def hf_folder(output_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def write(output_dir: str | os.PathLike[str], step: int, native: Path, state: Any) -> Path:
    """HF's folder for the checkpoint ``native`` of ``step``; returns it."""
    folder = hf_folder(output_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    for entry in [LINK, *(p.name for p in Path(native).iterdir())]:
        link, target = folder / entry, Path(native) if entry == LINK else Path(native) / entry
        if link.is_symlink() or link.is_file():
            link.unlink()
        link.symlink_to(os.path.relpath(target, folder), target_is_directory=target.is_dir())
    state.save_to_json(folder / TRAINER_STATE_NAME)
    _prune(Path(output_dir))
    return folder


def _prune(output_dir: Path) -> None:
    """Remove HF folders whose hookloop checkpoint was rotated away."""
    for folder in output_dir.glob("checkpoint-*"):
        link = folder / LINK
        if link.is_symlink() and not link.exists():
            shutil.rmtree(folder, ignore_errors=True)


def last_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The ``checkpoint-N`` folder of ``output_dir`` with the highest N (None: none), as
    transformers' ``get_last_checkpoint`` finds it."""
    found = []
    for folder in Path(output_dir).glob("checkpoint-*"):
        number = folder.name.removeprefix("checkpoint-")
        if number.isdigit() and folder.is_dir():
            found.append((int(number), folder))
    return max(found)[1] if found else None


def native_checkpoint(path: str | os.PathLike[str]) -> str:
    """The hookloop checkpoint behind an HF folder (any other path as given)."""
    link = Path(path) / LINK
    return str(link.resolve()) if link.is_symlink() else str(path)


@dataclasses.dataclass
class HFRetention(SavePolicy):
    """HF's ``save_total_limit``: the newest ``keep_last`` checkpoints, the best one
    counted among them (moved to second newest), and two when the limit is one and
    the best is not the newest."""

    def to_keep(self, manifests: list[dict[str, Any]], latest: str | None) -> set[str]:
        if self.keep_last is None:
            return {m["name"] for m in manifests}
        names = [m["name"] for m in sorted(manifests, key=lambda m: m.get("step", -1))]
        scored = [m for m in manifests if isinstance(m.get("metric"), (int, float))]
        limit = self.keep_last
        if self.monitor and scored:
            scored.sort(key=lambda m: (m["metric"], m.get("step", -1)), reverse=self.mode == "max")
            best = scored[0]["name"] if self.mode == "min" else _earliest_best(scored)
            names.remove(best)
            names.insert(max(len(names) - 1, 0), best)
            if limit == 1 and names[-1] != best:
                limit = 2
        keep = set(names[-limit:])
        if latest:
            keep.add(latest)
        return keep


def _earliest_best(scored: list[dict[str, Any]]) -> str:
    """Among equal best (max) metrics, the earliest step: HF keeps the first best."""
    top = scored[0]["metric"]
    return min((m for m in scored if m["metric"] == top), key=lambda m: m.get("step", -1))["name"]
