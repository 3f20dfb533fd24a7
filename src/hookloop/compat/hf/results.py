"""What transformers' example scripts call after ``train()``: the model saved for
``from_pretrained``, the state and metrics saved as JSON, the metrics printed.

The files are transformers' own (:meth:`Trainer.save_model`):

- a model with ``save_pretrained`` (a ``PreTrainedModel``) saves itself: ``config.json``,
  ``model.safetensors`` (and ``generation_config.json`` where it has one); any other
  module's ``state_dict`` goes to ``model.safetensors`` with ``{"format": "pt"}``;
- the processing class (tokenizer, processor), or else the collator's tokenizer, saves
  itself beside it;
- ``training_args.bin`` is the arguments, pickled with ``torch.save``.

``save_metrics(split, metrics)`` writes ``{split}_results.json`` in ``output_dir`` and
folds the same keys into ``all_results.json``; ``save_state()`` writes
``trainer_state.json`` there. All of them write on the world's rank 0 only.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookloop.compat.hf import console

SAFE_WEIGHTS_NAME = "model.safetensors"
TRAINING_ARGS_NAME = "training_args.bin"
TRAINER_STATE_NAME = "trainer_state.json"


def world_rank() -> int:
    """This process's rank in the world (0 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its node (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def output_dir(args: Any, given: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    """``given``, else ``args.output_dir``: where the Trainer's files go."""
    out = given if given is not None else getattr(args, "output_dir", None)
    if out is None:
        raise ValueError("no output_dir: set TrainingArguments.output_dir or pass one")
    return out


def save_model(
    model: torch.nn.Module,
    output_dir: str | os.PathLike[str],
    *,
    args: Any,
    processing_class: Any = None,
    data_collator: Any = None,
) -> Path:
    """The model, its processing class and ``training_args.bin`` in ``output_dir``,
    as transformers' ``Trainer.save_model`` writes them (see the module doc)."""
    out = Path(output_dir)
    if world_rank() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    console.announce_saving(out)
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained(str(out))
    else:
        from safetensors.torch import save_file

        console.announce_model_written(out, model)  # transformers' note for a plain module
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(out / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    tokenizer = getattr(data_collator, "tokenizer", None)
    saver = processing_class if processing_class is not None else tokenizer
    if saver is not None:
        if saver is not processing_class:
            console.announce_collator_tokenizer()
        saver.save_pretrained(str(out))
    torch.save(args, out / TRAINING_ARGS_NAME)
    return out


def metrics_format(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics as ``log_metrics`` prints them: runtimes as ``H:MM:SS.cc``, memory in MB,
    ``total_flos`` in GF, other floats to four decimals."""
    shown: dict[str, Any] = {}
    for key, value in metrics.items():
        if "_mem_" in key:
            shown[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key:
            shown[key] = _duration(value)
        elif key == "total_flos":
            shown[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            shown[key] = round(value, 4)
        else:
            shown[key] = value
    return shown


def _duration(seconds: float) -> str:
    """``H:MM:SS.cc``: whole seconds as a timedelta, then hundredths (cut, not rounded)."""
    hundredths = int(abs(seconds - int(seconds)) * 100)
    return f"{datetime.timedelta(seconds=int(seconds))}.{hundredths:02d}"


def log_metrics(split: str, metrics: Mapping[str, Any]) -> None:
    """Print ``***** {split} metrics *****`` and one aligned ``key = value`` line per
    metric, sorted by key (world rank 0 only)."""
    _check_split(split)
    if world_rank() != 0:
        return
    print(f"***** {split} metrics *****")
    shown = metrics_format(metrics)
    if not shown:
        return
    key_width = max(len(str(k)) for k in shown)
    value_width = max(len(str(v)) for v in shown.values())
    for key in sorted(shown):
        print(f"  {key: <{key_width}} = {shown[key]:>{value_width}}")


def save_metrics(
    output_dir: str | os.PathLike[str],
    split: str,
    metrics: Mapping[str, Any],
    *,
    combined: bool = True,
) -> None:
    """``{split}_results.json`` and, with ``combined``, the same keys merged into
    ``all_results.json`` (indented by 4, keys sorted; world rank 0 only)."""
    _check_split(split)
    if world_rank() != 0:
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / f"{split}_results.json", dict(metrics))
    if combined:
        everything = out / "all_results.json"
        merged: dict[str, Any] = {}
        if everything.exists():
            try:
                merged = json.loads(everything.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{everything} is not JSON ({e.msg} at line {e.lineno}); move it away "
                    "or pass combined=False"
                ) from None
            if not isinstance(merged, dict):
                raise ValueError(f"{everything} holds a {type(merged).__name__}, not an object")
        merged.update(metrics)
        _write_json(everything, merged)


def save_state(state: Any, output_dir: str | os.PathLike[str]) -> None:
    """``trainer_state.json`` in ``output_dir`` (world rank 0 only)."""
    if world_rank() != 0:
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    state.save_to_json(out / TRAINER_STATE_NAME)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Written beside, then renamed over: a crash never leaves half a file."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=4, sort_keys=True)
    os.replace(partial, path)


def _check_split(split: Any) -> None:
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty name such as 'train' or 'eval', got {split!r}")


def write_checkpoint_extras(
    folder: Path,
    *,
    model: torch.nn.Module,
    scheduler: Any,
    args: Any,
    processing_class: Any = None,
    data_collator: Any = None,
) -> None:
    """transformers' files of a ``checkpoint-N`` that hookloop's checkpoint lacks: the
    model's ``config.json`` (and ``generation_config.json``), the tokenizer,
    ``scheduler.pt``, ``rng_state.pth`` and ``training_args.bin``."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        if callable(getattr(model, "save_pretrained", None)):
            # what a model's own save_pretrained records in its config before writing it
            config.architectures = [type(model).__name__]
            config.dtype = str(model.dtype).removeprefix("torch.")
        config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(str(folder))
    console.announce_model_written(folder, model)  # copied from hookloop's checkpoint
    tokenizer = getattr(data_collator, "tokenizer", None)
    saver = processing_class if processing_class is not None else tokenizer
    if saver is not None:
        if saver is not processing_class:
            console.announce_collator_tokenizer()
        saver.save_pretrained(str(folder))
    if scheduler is not None:
        torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    torch.save(rng_states(), folder / _rng_file())
    torch.save(args, folder / TRAINING_ARGS_NAME)


def rng_states() -> dict[str, Any]:
    """The generators' states as transformers keeps them in ``rng_state.pth``."""
    import random

    import numpy as np

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _rng_file() -> str:
    """``rng_state.pth`` for one process, ``rng_state_{rank}.pth`` for several."""
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if initialised and torch.distributed.get_world_size() > 1:
        return f"rng_state_{torch.distributed.get_rank()}.pth"
    return "rng_state.pth"
