"""The DiLoCo server's checkpoints, in Forgather's layout.

A checkpoint is a directory holding the global weights as an HF-style model
(``model.safetensors``, ``pytorch_model.bin``, or a sharded index of either)
and, once the server has run, ``server_state.pt`` (outer optimizer, round,
expected workers, parameter names). The server starts from one; it saves to
``<output_dir>/checkpoints/checkpoint-<round>`` and keeps the newest
``save_total_limit``. Forgather's server reads what this writes and the other
way round. Every torch file is read by :func:`hookloop.safeload.load` (``weights_only``,
stored zip entries only: a file takes no more memory than its size on disk, which is
the cap: the server wrote it, or an operator copied it in).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hookloop.safeload import RefusedFile, load

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
SERVER_STATE = "server_state.pt"
_WEIGHT_FILES = (SAFE_INDEX, TORCH_INDEX, SAFE_WEIGHTS, TORCH_WEIGHTS)


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding model weights in one of the known files."""
    return Path(path).is_dir() and any((Path(path) / f).is_file() for f in _WEIGHT_FILES)


def check_output_dir(output_dir: str | Path) -> None:
    """Refuse, at start, an output directory that is a file or cannot be written."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"output dir {output_dir} is a file; give a directory (created when missing) for "
            "the server's checkpoints"
        )
    for parent in (path, *path.parents):
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise NotADirectoryError(f"output dir {output_dir}: {parent} is a file")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(
                f"output dir {output_dir}: {parent} is not writable; give a directory the "
                "server can write its checkpoints to"
            )
        return


def find_all(output_dir: str | Path) -> list[Path]:
    """The checkpoints under ``output_dir/checkpoints``, newest first (by modification time),
    else ``[output_dir]`` when it is a model directory itself, else []."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return [Path(output_dir)] if is_checkpoint(output_dir) else []
    found = [p for p in root.glob("checkpoint-*") if is_checkpoint(p)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find_latest(output_dir: str | Path) -> Path | None:
    """The newest checkpoint under ``output_dir/checkpoints`` (by modification time), else
    ``output_dir`` itself when it is a model directory, else None (as Forgather)."""
    found = find_all(output_dir)
    return found[0] if found else None


def _damaged(path: Path, err: BaseException) -> ValueError:
    text = " ".join(str(err).split()).split(". ")[0][:200] or type(err).__name__
    if isinstance(err, RefusedFile):
        text = err.reason  # one line already, and it names what is allowed
    return ValueError(f"{path} is damaged or truncated ({text}); it cannot be loaded")


def _load_torch(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = load(path)
    except Exception as err:  # torch raises several types for a torn or foreign file
        raise _damaged(path, err) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a state dict")
    return data


def _load_safe(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except Exception as err:  # safetensors' own error type for a torn header or body
        raise _damaged(path, err) from None


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of the model checkpoint at ``path``, in the files' order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"the checkpoint path {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"the checkpoint path {path} is not a directory")
    for index, reader in ((SAFE_INDEX, _load_safe), (TORCH_INDEX, _load_torch)):
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
                raise ValueError(
                    f"{path / index} is not an index (JSON with a weight_map object)"
                ) from None
            state: dict[str, torch.Tensor] = {}
            for shard in dict.fromkeys(weight_map.values()):
                if Path(shard).name != shard:
                    raise ValueError(f"{path / index} names a shard outside its directory")
                state.update(reader(path / shard))
            missing = [n for n in weight_map if n not in state]
            if missing:
                raise ValueError(f"{path / index} names {missing[:3]}, which no shard holds")
            return {n: state[n] for n in weight_map}
    if (path / SAFE_WEIGHTS).is_file():
        return _load_safe(path / SAFE_WEIGHTS)
    if (path / TORCH_WEIGHTS).is_file():
        return _load_torch(path / TORCH_WEIGHTS)
    raise ValueError(f"{path} holds no model weights (expected one of {', '.join(_WEIGHT_FILES)})")


def load_server_state(path: str | Path) -> dict[str, Any] | None:
    """``server_state.pt`` of a checkpoint, or None when it has only weights."""
    file = Path(path) / SERVER_STATE
    if not file.is_file():
        return None
    try:
        state = load(file)
    except Exception as err:  # torch raises several types for a torn or foreign file
        raise _damaged(file, err) from None
    if not isinstance(state, dict) or "outer_optimizer" not in state or "sync_round" not in state:
        raise ValueError(f"{file} lacks outer_optimizer / sync_round")
    return state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    directory: str | Path, weights: dict[str, torch.Tensor], server_state: dict[str, Any]
) -> Path:
    """Write a checkpoint to ``directory`` atomically.

    The files are written and synced in a hidden staging directory that is then
    renamed into place; a checkpoint already there under that name is moved aside
    first and only deleted once the new one is in place. A failed write (a full disk)
    removes the staging directory and leaves every existing checkpoint as it was.
    """
    directory = Path(directory)
    staging = directory.with_name(f".{directory.name}.tmp")
    aside = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        save_file({n: t.contiguous() for n, t in weights.items()}, staging / SAFE_WEIGHTS)
        torch.save(server_state, staging / SERVER_STATE)
        for name in (SAFE_WEIGHTS, SERVER_STATE):
            _fsync(staging / name)
        shutil.rmtree(aside, ignore_errors=True)
        if directory.exists():
            os.replace(directory, aside)
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if aside.exists() and not directory.exists():
            os.replace(aside, directory)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(OSError):  # make the rename durable where the OS allows it
        _fsync(directory.parent)
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
