"""Entry points in the Megatron style: a config container and a forward step.

``pretrain(config, forward_step)`` builds the model and data from the config's
recipe, seeds every RNG, and runs the same :class:`~hookloop.Trainer` you can
build by hand. ``finetune`` does the same from pretrained weights.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookloop.callback import Callback
from hookloop.config import Config
from hookloop.manager import CallbackManager
from hookloop.recipes import get_recipe
from hookloop.trainer import Trainer, TrainResult


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_trainer(
    config: Config,
    forward_step: Any = None,
    callbacks: CallbackManager | Iterable[Callback] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
) -> Trainer:
    """Seed, build the recipe's parts, and assemble a Trainer (without training)."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a hookloop Config, got {type(config).__name__}")
    config.validate()
    seed_everything(config.seed)
    parts = get_recipe(config.recipe).build(config)
    manager = callbacks if isinstance(callbacks, CallbackManager) else CallbackManager(callbacks)
    if parts.callbacks:
        manager.add(parts.callbacks)
    return Trainer(
        parts.model,
        train_data=parts.train_data,
        eval_data=parts.eval_data,
        test_data=parts.test_data,
        config=config,
        callbacks=manager,
        forward_step=forward_step or parts.forward_step,
        loss_fn=None if (forward_step or parts.forward_step) else parts.loss_fn,
        out_dir=None if out_dir is None else str(out_dir),
        resume=resume,
        flops_per_sample=parts.flops_per_sample,
    )


def pretrain(
    config: Config,
    forward_step: Any = None,
    callbacks: CallbackManager | Iterable[Callback] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
) -> TrainResult:
    """Train the config's recipe from scratch; ``callbacks`` is a list or a manager."""
    return build_trainer(config, forward_step, callbacks, out_dir=out_dir, resume=resume).train()


def finetune(
    config: Config,
    forward_step: Any = None,
    callbacks: CallbackManager | Iterable[Callback] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: str | None = None,
) -> TrainResult:
    """Like ``pretrain``, starting from the weights at ``config.checkpoint.pretrained``.

    Only the model weights are loaded (a fresh optimizer, schedule and data
    order); to continue an interrupted run use ``resume`` instead.
    """
    if not config.checkpoint.pretrained:
        raise ValueError(
            "finetune() needs config.checkpoint.pretrained: a checkpoint directory or a "
            ".safetensors file with the pretrained weights"
        )
    trainer = build_trainer(config, forward_step, callbacks, out_dir=out_dir, resume=resume)
    if resume is None:
        load_weights(trainer.model, config.checkpoint.pretrained)
    return trainer.train()


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load model weights from a ``.safetensors`` file or a checkpoint directory.

    A checkpoint directory (or a run's ``checkpoints`` folder, whose ``latest``
    is taken) holds either ``model.safetensors`` or, from an FSDP2 run, DCP
    shards under ``sharded/``; either loads into a plain or a sharded model
    (with several ranks, call it on every rank). Tied weights (a GPT's shared
    embedding and output matrix) are stored once and restored under both names.
    """
    path = Path(path)
    if path.is_dir():
        path = _checkpoint_weights(path)
    if not path.exists():
        raise FileNotFoundError(f"pretrained weights not found: {path}")
    if path.is_dir():  # DCP shards
        _load_dcp_weights(model, path)
        return
    from hookloop.distributed import is_sharded

    if is_sharded(model):
        _load_full_into_sharded(model, path)
        return
    from safetensors.torch import load_model

    device = next((str(p.device) for p in model.parameters()), "cpu")
    missing, unexpected = load_model(model, str(path), strict=False, device=device)
    _check_fit(path, missing, unexpected)


def _checkpoint_weights(directory: Path) -> Path:
    """The weights inside a checkpoint directory or a folder of checkpoints."""
    from hookloop.checkpoint import SHARDED_DIR

    places = [directory]
    latest = directory / "latest"
    if latest.is_file():
        places.insert(0, directory / latest.read_text().strip())
    elif latest.is_dir():
        places.append(latest)
    for place in places:
        for candidate in (place / "model.safetensors", place / SHARDED_DIR):
            if candidate.exists():
                return candidate
    raise FileNotFoundError(
        f"no model.safetensors or {SHARDED_DIR}/ (FSDP2 shards) in checkpoint directory "
        f"{directory} or its latest checkpoint"
    )


def _load_dcp_weights(model: torch.nn.Module, shards: Path) -> None:
    """Read the model part of a DCP checkpoint, resharding to however ``model`` is laid out."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    single = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: we asked it to
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(shards), no_dist=single)
    except dcp.CheckpointException as err:
        raise ValueError(f"weights in {shards} do not fit the model: {err}") from None
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


def _check_fit(path: Path, missing: Any, unexpected: Any) -> None:
    if missing or unexpected:
        raise ValueError(
            f"weights in {path} do not fit the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
