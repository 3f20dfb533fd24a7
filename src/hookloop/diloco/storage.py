"""The DiLoCo server's checkpoints, in Forgather's layout.

A checkpoint is a directory holding the global weights as an HF-style model
(``model.safetensors``, ``pytorch_model.bin``, or a sharded index of either)
and, once the server has run, ``server_state.pt`` (outer optimizer, round,
expected workers, parameter names). The server starts from one; it saves to
``<output_dir>/checkpoints/checkpoint-<round>`` and keeps the newest
``save_total_limit``. Forgather's server reads what this writes and the other
way round. Everything is read with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
SERVER_STATE = "server_state.pt"
_WEIGHT_FILES = (SAFE_INDEX, TORCH_INDEX, SAFE_WEIGHTS, TORCH_WEIGHTS)


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding model weights in one of the known files."""
    return Path(path).is_dir() and any((Path(path) / f).is_file() for f in _WEIGHT_FILES)


def find_latest(output_dir: str | Path) -> Path | None:
    """The newest checkpoint under ``output_dir/checkpoints`` (by modification time), else
    ``output_dir`` itself when it is a model directory, else None (as Forgather)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return Path(output_dir) if is_checkpoint(output_dir) else None
    found = [p for p in root.glob("checkpoint-*") if is_checkpoint(p)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _load_torch(path: Path) -> dict[str, torch.Tensor]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a state dict")
    return data


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of the model checkpoint at ``path``, in the files' order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"the checkpoint path {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"the checkpoint path {path} is not a directory")
    for index, reader in ((SAFE_INDEX, load_file), (TORCH_INDEX, _load_torch)):
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for shard in dict.fromkeys(weight_map.values()):
                if Path(shard).name != shard:
                    raise ValueError(f"{path / index} names a shard outside its directory")
                state.update(reader(path / shard))
            return {n: state[n] for n in weight_map}
    if (path / SAFE_WEIGHTS).is_file():
        return load_file(path / SAFE_WEIGHTS)
    if (path / TORCH_WEIGHTS).is_file():
        return _load_torch(path / TORCH_WEIGHTS)
    raise ValueError(f"{path} holds no model weights (expected one of {', '.join(_WEIGHT_FILES)})")


def load_server_state(path: str | Path) -> dict[str, Any] | None:
    """``server_state.pt`` of a checkpoint, or None when it has only weights."""
    file = Path(path) / SERVER_STATE
    if not file.is_file():
        return None
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "outer_optimizer" not in state or "sync_round" not in state:
        raise ValueError(f"{file} lacks outer_optimizer / sync_round")
    return state


def save(
    directory: str | Path, weights: dict[str, torch.Tensor], server_state: dict[str, Any]
) -> Path:
    """Write a checkpoint to ``directory`` atomically (a torn write leaves the old one)."""
    directory = Path(directory)
    staging = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, staging / SAFE_WEIGHTS)
    torch.save(server_state, staging / SERVER_STATE)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(staging, directory)
    return directory


def rotate(output_dir: str | Path, keep: int) -> None:
    """Delete the oldest ``checkpoint-*`` beyond the newest ``keep`` (0 keeps all)."""
    if keep <= 0:
        return
    found = sorted((Path(output_dir) / "checkpoints").glob("checkpoint-*"), key=os.path.getmtime)
    for old in found[: max(0, len(found) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def save_initial(directory: str | Path, model: torch.nn.Module) -> Path:
    """Write ``model``'s parameters (not its buffers: the pseudo-gradients cover parameters
    only) as a checkpoint a server can start from."""
    weights = {n: p.detach().cpu() for n, p in model.named_parameters()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, directory / SAFE_WEIGHTS)
    return directory
