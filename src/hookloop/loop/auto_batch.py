"""``data.batch_size=auto``: the largest per-rank batch that fits, found before training.

Before the loaders open, the model runs forward and backward on the first rows of the
training dataset, from ``data.auto_batch_start`` rows down, halving after each
out-of-memory error (:func:`hookloop.batch_finder.is_out_of_memory`: torch's
``OutOfMemoryError`` and the allocator messages accelerate treats so). With several
ranks every try is agreed (one all-reduce): a size that fails on any rank fails on all,
so every rank trains with the same batch. The RNGs are put back as they were, and the
gradients cleared, so the run is the one ``data.batch_size=N`` gives; the size found is
written into the config (``config.yaml`` and checkpoints record the number).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hookloop.batch_finder import free_memory, halve, is_out_of_memory
from hookloop.config import Config
from hookloop.data import collate_rows, is_map_style
from hookloop.distributed import agree_flags
from hookloop.errors import ConfigError
from hookloop.loop.records import Compute
from hookloop.step import LossReducer

log = logging.getLogger("hookloop.auto_batch")


def fit_batch_size(
    config: Config,
    model: torch.nn.Module,
    data: Any,
    compute: Compute,
    world_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> int:
    """The batch size to train with (see the module doc); sets ``config.data.batch_size``
    when it is ``auto``, and otherwise returns it as it is."""
    if config.data.batch_size != "auto":
        return config.data.batch_size
    if not is_map_style(data):
        raise ConfigError(
            "data.batch_size=auto needs a training dataset hookloop batches (an object with "
            f"__getitem__ and __len__); this run's train data is a {type(data).__name__}"
        )
    size = min(config.data.auto_batch_start, max(1, len(data) // world_size))
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    tried = []
    try:
        while size >= 1:
            tried.append(size)
            failed = _try(size, model, data, compute, collate_fn or collate_rows)
            if not agree_flags([int(failed)], compute.device)[0]:
                break
            size = halve(size)
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        for p in model.parameters():
            p.grad = None
    if size < 1:
        raise ConfigError("data.batch_size=auto: even a batch of 1 ran out of memory")
    log.info("data.batch_size=auto: %d fits (tried %s)", size, ", ".join(map(str, tried)))
    config.data.batch_size = size
    return size


def _try(
    size: int, model: torch.nn.Module, data: Any, compute: Compute, collate: Callable[..., Any]
) -> bool:
    """Whether forward and backward on ``size`` rows ran out of memory (any other error is
    the user's and propagates)."""
    batch = collate([data[i] for i in range(size)])
    try:
        with compute.precision.autocast():
            output, loss_func = compute.forward(compute.state, iter([batch]), model)
            loss, _ = LossReducer().add(loss_func(output))
        compute.precision.backward(loss)
        return False
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        log.info("data.batch_size=auto: %d rows ran out of memory", size)
        return True
    finally:
        del batch
        for p in model.parameters():
            p.grad = None
        free_memory()
