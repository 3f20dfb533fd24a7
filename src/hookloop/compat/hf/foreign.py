"""Resuming from a ``checkpoint-N`` folder that transformers' own Trainer wrote.

Such a folder has no hookloop manifest: its files are transformers' (the model's
``model.safetensors`` or ``pytorch_model.bin``, sharded or not, ``optimizer.pt``,
``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``). They are read into
the loop's own state before training starts, the way transformers' ``train()``
reads them: the weights, the optimizer and the schedule as saved; the counters
from ``global_step`` (the epoch and the place in it as transformers derives them,
so the data goes on where transformers' run would); the log history, the best
metric and checkpoint, and, with ``restore_callback_states_from_checkpoint``,
the callbacks' saved states; the random generators last.

Nothing in the folder is checksummed (transformers writes no manifest), so each
file is checked for what it must hold, and any failure names the file. The folder may
come from anyone, so every torch file in it is read by :func:`hookloop.safeload.load`:
tensors and plain containers only, and for ``rng_state.pth`` also NumPy arrays, under
the fixed four names transformers allows for that file; a file naming anything else
(any other NumPy function included) is refused before anything in it runs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookloop.safeload import RefusedFile, load

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def resume(folder: Path, named_state: dict[str, Any], *, steps_per_epoch: int,
           samples_per_step: int) -> int:  # fmt: skip
    """Load ``folder`` into the loop's ``named_state``; returns the step resumed at."""
    state = _json(folder / "trainer_state.json")
    step = state.get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"{folder / 'trainer_state.json'}: global_step must be an int >= 0, got {step!r}"
        )
    _load_weights(folder, named_state["model"])
    named_state["optimizer"].load_state_dict(_torch(folder / "optimizer.pt"))
    if "scheduler" in named_state:
        if not (folder / "scheduler.pt").is_file():
            raise FileNotFoundError(
                f"{folder} has no scheduler.pt; this run has a learning-rate schedule to restore"
            )
        named_state["scheduler"].load_state_dict(_torch(folder / "scheduler.pt"))
    per_epoch = max(steps_per_epoch, 1)
    named_state["train_state"].load_state_dict(
        {
            "step": step,
            "epoch": step // per_epoch,
            "epoch_step": step % per_epoch,
            "samples": step * samples_per_step,
            "tokens": int(state.get("num_input_tokens_seen") or 0),
            "flops": float(state.get("total_flos") or 0.0),
        }
    )
    hf_state = named_state["callbacks"].callbacks.get("hf.TrainerState")
    if hf_state is not None:
        kept = ("log_history", "best_metric", "best_global_step", "best_model_checkpoint")
        hf_state.load_state_dict(
            {
                **{k: state.get(k) for k in kept},
                "stateful_callbacks": state.get("stateful_callbacks") or {},
            }
        )
    _load_rng(folder / "rng_state.pth")
    return step


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _torch(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; transformers' Trainer writes it at each save")
    try:
        return load(path)  # capped by the file's own size: stored entries do not inflate
    except Exception as err:
        raise ValueError(f"{path} cannot be loaded: {_first_line(err)}") from None


def _load_weights(folder: Path, model: torch.nn.Module) -> None:
    """The model's weights, whole or sharded; a weight tied to another may be absent."""
    weights = _read_weights(folder)
    own = model.state_dict(keep_vars=True)
    unexpected = sorted(set(weights) - set(own))
    missing = [k for k in own if k not in weights]
    loaded_ptrs = {own[k].data_ptr() for k in own if k in weights}
    untied = [k for k in missing if own[k].data_ptr() not in loaded_ptrs]
    if unexpected or untied:
        raise ValueError(
            f"{folder}'s weights do not fit this model: "
            + "; ".join(
                part
                for part in (
                    f"unexpected {', '.join(unexpected[:5])}" if unexpected else "",
                    f"missing {', '.join(untied[:5])}" if untied else "",
                )
                if part
            )
        )
    model.load_state_dict(weights, strict=False)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHTS:
        if (folder / name).is_file():
            return _weights_file(folder / name)
    for name in INDEXES:
        if (folder / name).is_file():
            index = _json(folder / name).get("weight_map")
            if not isinstance(index, dict):
                raise ValueError(f"{folder / name} has no weight_map")
            weights: dict[str, torch.Tensor] = {}
            for shard in sorted(set(index.values())):
                weights.update(_weights_file(folder / str(shard)))
            return weights
    raise FileNotFoundError(
        f"{folder} holds no model weights (looked for {', '.join(WEIGHTS + INDEXES)})"
    )


def _weights_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:
            raise ValueError(f"{path} cannot be loaded: {_first_line(err)}") from None
    return _torch(path)


def _load_rng(path: Path) -> None:
    """transformers' ``rng_state.pth``: Python's, NumPy's and torch's generators."""
    if not path.is_file():
        return  # transformers resumes without it too (with a warning of its own)
    try:
        saved = load(path, numpy_arrays=True)
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        torch.random.set_rng_state(saved["cpu"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.random.set_rng_state_all(saved["cuda"])
    except Exception as err:
        raise ValueError(f"{path} cannot be restored: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    if isinstance(err, RefusedFile):
        return err.reason  # already one line; the caller names the file
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
