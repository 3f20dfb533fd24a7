"""Weights only (finetuning, exports): a model's weights from a checkpoint or a file.

:func:`load_weights` reads ``model.safetensors`` or, from an FSDP2 run, the DCP
shards under ``sharded/``, into a plain or a sharded model, with the same errors as a
resume: a weight that does not fit names itself.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from hookloop.checkpoint.storage import SHARDED_DIR, CheckpointError, resolve_checkpoint
from hookloop.distributed import is_distributed, is_sharded


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
        load_safetensors(model, path)


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

    full: dict[str, Any] = load_file(str(path))  # as DCP's state dicts are typed
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


def load_safetensors(model: torch.nn.Module, path: Path) -> None:
    """Load a safetensors file into a plain model (tied weights are stored once)."""
    from safetensors.torch import load_model

    try:
        missing, unexpected = load_model(
            model, str(path), strict=False, device=str(device_of(model))
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


def device_of(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))
