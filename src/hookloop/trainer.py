"""The Trainer a user builds: the loop plus the run's default callbacks.

:class:`hookloop.loop.Trainer` is the bare loop: it fires events and writes nothing but
checkpoints. A run given a directory (``out_dir``) is expected to show and keep what
``hookloop train`` shows and keeps, so :class:`Trainer` adds the same default set
(:func:`hookloop.callbacks.defaults.default_callbacks`, switched by the config's
``callbacks.*`` and ``logging.*`` keys): the run summary, progress on stderr, the
metrics in ``metrics.jsonl`` (which ``hookloop runs`` reads), TensorBoard (when it is
installed), and a line saying where a resume started. They are added beside the user's
own callbacks; a user callback of the same class as a default one replaces it;
``default_callbacks=False`` keeps them all out, and ``True`` adds them without a run
directory (no files then).

transformers' Trainer, Megatron-Bridge and Forgather build on the bare loop, so their
output stays their original's. The HPO trainer's callbacks run inside this Trainer:
with ``out_dir`` give ``default_callbacks=False`` to keep its output alone.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.callbacks.defaults import default_callbacks as build_defaults
from hookloop.loop import trainer as loop
from hookloop.loop.inputs import as_config, as_manager
from hookloop.manager import CallbackManager

__all__ = ["Trainer", "with_default_callbacks"]


class Trainer(loop.Trainer):
    """:class:`hookloop.loop.Trainer` (every argument the same), plus
    ``default_callbacks``: None (the default) adds the run's default callbacks when
    ``out_dir`` is given, True always, False never (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        default_callbacks: bool | None = None,
        **inputs: Any,
    ) -> None:
        if default_callbacks not in (None, True, False):
            raise TypeError(
                f"default_callbacks must be None, True or False, got {default_callbacks!r}"
            )
        out_dir = inputs.get("out_dir")
        wanted = out_dir is not None if default_callbacks is None else default_callbacks
        if wanted and inputs.get("dialect") is None:
            inputs["callbacks"] = with_default_callbacks(
                inputs.get("callbacks"), as_config(inputs.get("config")), out_dir
            )
        super().__init__(model, optimizer, **inputs)


def with_default_callbacks(callbacks: Any, config: Any, out_dir: Any) -> CallbackManager:
    """``callbacks`` as a manager, with each default callback whose class none of them
    has added beside them."""
    manager = as_manager(callbacks)
    present = {type(cb) for cb in manager.callbacks}
    if config.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        config = dataclasses.replace(  # TensorBoard when it is installed
            config, logging=dataclasses.replace(config.logging, tensorboard=False)
        )
    defaults: list[Callback] = [
        cb for cb in build_defaults(config, out_dir) if type(cb) not in present
    ]
    if defaults:
        manager.add(defaults)
    return manager
