"""The DiLoCo server's checkpoints, in Forgather's layout.

A checkpoint is a directory holding the global weights as an HF-style model
(``model.safetensors``, ``pytorch_model.bin``, or a sharded index of either)
and, once the server has run, ``server_state.pt`` (outer optimizer, round,
expected workers, parameter names). The server starts from one; it saves to
``<output_dir>/checkpoints/checkpoint-<round>`` and keeps the newest
``save_total_limit``. Forgather's server reads what this writes and the other
way round.

Checkpoints are ordered, and rotated, by the round in their names, never by a file's
modification time (one ``touch`` would otherwise rewind a restart, and the rounds after
it would overwrite the real newest checkpoint); the one chosen must record that round in
its ``server_state.pt`` (:func:`check_round`): a copy under another name is refused.
Weights are matched to the saved state by name (:func:`in_saved_order`), so a server
resumes from what it wrote whatever the order of the files it started from (a sharded
index lists its parameters in any order; ``model.safetensors`` reads back sorted).

Every torch file is read by :func:`hookloop.safeload.load` (``weights_only``, stored zip
entries only: a file takes no more memory than its size on disk, which is the cap: the
server wrote it, or an operator copied it in).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
_ROUND_NAME = re.compile(r"checkpoint-(\d+)")
#: Names listed in full in a mismatch message; the rest are counted.
_SHOWN = 5


class RoundMismatch(ValueError):
    """A checkpoint records another round than its name says (copied or renamed)."""


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


def round_of(path: str | Path) -> int | None:
    """The round in a ``checkpoint-<round>`` directory's name (None: another name)."""
    match = _ROUND_NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def saved_rounds(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<round>`` directories under ``output_dir/checkpoints``, highest
    round first (whatever their files' times say)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(r, p) for p in root.iterdir() if (r := round_of(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def find_all(output_dir: str | Path) -> list[Path]:
    """The checkpoints under ``output_dir/checkpoints``, highest round first, else
    ``[output_dir]`` when it is a model directory itself, else []."""
    if not (Path(output_dir) / "checkpoints").is_dir():
        return [Path(output_dir)] if is_checkpoint(output_dir) else []
    return [p for p in saved_rounds(output_dir) if is_checkpoint(p)]


def find_latest(output_dir: str | Path) -> Path | None:
    """The checkpoint of the highest round under ``output_dir/checkpoints``, else
    ``output_dir`` itself when it is a model directory, else None (as Forgather)."""
    found = find_all(output_dir)
    return found[0] if found else None


def check_start(output_dir: str | Path, start: str | Path) -> None:
    """Refuse to start from ``start`` where ``output_dir`` already holds a run's
    checkpoints (other than ``start`` itself, a deliberate rewind): the new run's saves
    would mix with that run's, and rotation would remove them under its higher rounds."""
    saved = saved_rounds(output_dir)
    if not saved or Path(start).resolve() in {p.resolve() for p in saved}:
        return
    raise ValueError(
        f"output dir {output_dir} holds a run's checkpoints up to {saved[0].name}; starting "
        f"from {start} there would mix two runs' rounds: leave from_checkpoint out to "
        f"continue from {saved[0].name}, or give another output dir"
    )


def check_round(path: str | Path, state: dict[str, Any]) -> None:
    """Refuse (:class:`RoundMismatch`) a ``checkpoint-<round>`` whose ``server_state.pt``
    records another round: its name would put it where it does not belong."""
    named = round_of(path)
    recorded = state.get("sync_round")
    if named is not None and recorded != named:
        raise RoundMismatch(
            f"{path} records round {recorded} in its {SERVER_STATE}, not {named}: a "
            "checkpoint's name must be its round (was it copied or renamed?); move it out "
            "of the checkpoints directory and start again"
        )


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def in_saved_order(
    weights: dict[str, torch.Tensor], state: dict[str, Any], where: str | Path
) -> dict[str, torch.Tensor]:
    """``weights`` in the order of the parameters ``state`` (a ``server_state.pt``) names,
    each matched by name and its shape checked against the outer optimizer's state for it;
    a ValueError names what is missing, unexpected or of another shape."""
    if state.get("param_names") is None:
        return weights  # written before the names were saved: the files' order it is
    names = [str(n) for n in state["param_names"]]
    known = set(names)
    missing = [n for n in names if n not in weights]
    unexpected = [n for n in weights if n not in known]
    reshaped = _reshaped(weights, names, state.get("outer_optimizer", {}))
    if missing or unexpected or reshaped:
        parts = [f"missing {_listed(missing)}"] if missing else []
        parts += [f"unexpected {_listed(unexpected)}"] if unexpected else []
        parts += reshaped[:_SHOWN]
        raise ValueError(f"{where}: the weights do not fit its {SERVER_STATE} ({'; '.join(parts)})")
    return {n: weights[n] for n in names}


def _reshaped(
    weights: dict[str, torch.Tensor], names: list[str], optimizer: dict[str, Any]
) -> list[str]:
    """Each parameter whose weight has another shape than its outer-optimizer state (the
    momentum buffer, saved by the parameter's position in ``names``)."""
    per_param = optimizer.get("state", {})
    found = []
    for i, name in enumerate(names):
        buffers = per_param.get(i, {}).values()
        shapes = {tuple(b.shape) for b in buffers if isinstance(b, torch.Tensor) and b.dim()}
        if name in weights and shapes and shapes != {tuple(weights[name].shape)}:
            found.append(
                f"{name} has shape {tuple(weights[name].shape)}, its outer-optimizer state "
                f"{min(shapes)}"
            )
    return found


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
    """Delete the ``checkpoint-<round>`` directories beyond the ``keep`` of the highest
    rounds (0 keeps all)."""
    if keep <= 0:
        return
    for old in saved_rounds(output_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def save_initial(directory: str | Path, model: torch.nn.Module) -> Path:
    """Write ``model``'s parameters (not its buffers: the pseudo-gradients cover parameters
    only) as a checkpoint a server can start from."""
    weights = {n: p.detach().cpu() for n, p in model.named_parameters()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, directory / SAFE_WEIGHTS)
    return directory
