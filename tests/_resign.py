"""Re-signing a checkpoint's manifest after its files were changed: what a tool or an
adversary does, so that only the content itself can tell a damaged checkpoint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from hookloop.checkpoint import MANIFEST, STATE_FILE
from hookloop.checkpoint.storage import manifest_checksum


class Opaque:
    """A class ``torch.load(weights_only=True)`` refuses to unpickle."""


def resign(ckpt: Path, *, fmt: int = 2) -> None:
    """Rewrite ``ckpt``'s manifest to match its files as they are now: sizes, digests and
    (format 2) the manifest's own checksum."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for fname in manifest["files"]:
        data = (ckpt / fname).read_bytes()
        manifest["files"][fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest.pop("checksum", None)
    manifest["format"] = fmt
    if fmt >= 2:
        manifest["checksum"] = manifest_checksum(manifest)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def replace_trainer_state(ckpt: Path, entries: object) -> None:
    """``ckpt``'s trainer_state.pt replaced by ``entries``, the manifest re-signed."""
    torch.save(entries, ckpt / STATE_FILE)
    resign(ckpt)
