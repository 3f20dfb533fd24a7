"""``TrainingArguments.accelerator_config`` and ``trainer.accelerator``.

transformers' Trainer runs on an ``accelerate.Accelerator`` built from
``accelerator_config`` (a dict, a JSON file's path, or transformers'
``AcceleratorConfig``). The dialect's loop does its own device placement, mixed
precision and data partition, so here:

- the configuration is read and checked as transformers reads it (a class instead
  of an instance, an unknown key and a step count given twice are refused);
- ``gradient_accumulation_kwargs["num_steps"]`` sets the accumulation, as there;
- the data settings (``split_batches``, ``dispatch_batches``, ``even_batches``)
  change nothing on one process, and are refused with several ranks; the
  seedable sampler is the dialect's data order (``use_seedable_sampler=False``
  is refused for training);
- ``trainer.accelerator`` is a real ``accelerate.Accelerator`` with those settings,
  built when first asked for, so code that calls ``trainer.accelerator.backward``,
  ``gather``, ``unwrap_model``, ``is_main_process`` … works as it does there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from hookloop.compat.hf.optim import arg

#: transformers' ``AcceleratorConfig`` fields and their defaults.
DEFAULTS: dict[str, Any] = {
    "split_batches": False,
    "dispatch_batches": None,
    "even_batches": True,
    "use_seedable_sampler": True,
    "non_blocking": False,
    "gradient_accumulation_kwargs": None,
    "use_configured_state": False,
}
_DATA = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler",
         "non_blocking")  # fmt: skip


def settings(config: Any) -> dict[str, Any]:
    """``accelerator_config`` as a dict of every setting (defaults filled in)."""
    if config is None:
        given: dict[str, Any] = {}
    elif isinstance(config, type) or (callable(config) and not dataclasses.is_dataclass(config)):
        raise NotImplementedError(
            "Tried passing in a callable to `accelerator_config`: give an AcceleratorConfig "
            "instance, a dict or the path of a JSON file instead"
        )
    elif isinstance(config, dict):
        given = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        try:
            given = json.loads(Path(config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"accelerator_config file {config} cannot be read: {err}") from None
        if not isinstance(given, dict):
            raise ValueError(f"accelerator_config file {config} must hold a JSON object")
    elif dataclasses.is_dataclass(config):
        given = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    else:
        raise TypeError(
            "accelerator_config must be a dict, a JSON file's path or an AcceleratorConfig, "
            f"got {type(config).__name__}"
        )
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"accelerator_config has no setting {', '.join(unknown)}; it takes "
            f"{', '.join(DEFAULTS)}"
        )
    out = {**DEFAULTS, **given}
    kwargs = out["gradient_accumulation_kwargs"]
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(
            f"accelerator_config's gradient_accumulation_kwargs must be a dict, got {kwargs!r}"
        )
    if out["use_configured_state"]:
        raise ValueError(
            "accelerator_config use_configured_state=True reuses an Accelerator's state, which "
            "hookloop.compat.hf.Trainer does not run on; leave it False"
        )
    return out


def accumulation_steps(config: dict[str, Any], given_steps: int) -> int:
    """The accumulation: ``num_steps`` of the config's gradient kwargs, unless the
    arguments set one too (refused, as transformers refuses it)."""
    num_steps = (config["gradient_accumulation_kwargs"] or {}).get("num_steps")
    if num_steps is None:
        return given_steps
    if given_steps > 1:
        raise ValueError(
            "The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is "
            f"{given_steps} in TrainingArguments; set the accumulation in one of them"
        )
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(
            f"gradient_accumulation_kwargs num_steps must be an int >= 1, got {num_steps!r}"
        )
    return num_steps


def check_reproduced(config: dict[str, Any], *, world_size: int, trains: bool) -> None:
    """Refuse the data settings the dialect's loader would not carry out."""
    odd = []
    if world_size > 1:
        odd += [k for k in _DATA[:3] if config[k] != DEFAULTS[k]]
    if trains and not config["use_seedable_sampler"]:
        odd.append("use_seedable_sampler")
    if odd:
        raise ValueError(
            "hookloop.compat.hf.Trainer does not carry out accelerator_config "
            + ", ".join(f"{k}={config[k]!r}" for k in odd)
            + "; leave them at "
            + ", ".join(f"{k}={DEFAULTS[k]!r}" for k in odd)
        )


def build(config: dict[str, Any], *, cpu: bool, mixed_precision: str) -> Any:
    """An ``accelerate.Accelerator`` with these settings, as transformers builds it."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    data = DataLoaderConfiguration(**{k: config[k] for k in _DATA})
    # the accumulation is the loop's: one step in accelerate's eyes (no double division)
    grad_kwargs = {**(config["gradient_accumulation_kwargs"] or {}), "num_steps": 1}
    return Accelerator(
        dataloader_config=data,
        gradient_accumulation_plugin=GradientAccumulationPlugin(**grad_kwargs),
        cpu=cpu,
        mixed_precision=mixed_precision,
    )


def for_args(config: dict[str, Any], args: Any, *, cpu: bool) -> Any:
    """:func:`build` with the mixed precision ``args`` ask for (``fp16``, ``bf16``)."""
    precision = "fp16" if arg(args, "fp16", False) else "no"
    if arg(args, "bf16", False):
        precision = "bf16"
    return build(config, cpu=cpu, mixed_precision=precision)
