"""One global batch's micro-batches, as Megatron-Core's schedule sees them.

It follows Megatron-Core's schedule without pipeline stages: for each micro-batch,
``forward_step(data_iterator, model)`` returns ``(output, loss_func)`` and
``loss_func(output)`` returns either

- ``(loss, num_tokens, loss_dict)``: the backward pass gets ``loss / num_tokens /
  num_microbatches``; or
- ``(loss, loss_dict)``: the backward pass gets ``loss / num_microbatches``.

Training runs the backward in hookloop's Stepper (:mod:`.native_step`); evaluation
runs the forward passes alone (:func:`forward_passes`).

Each micro-batch's ``loss_dict`` is kept; :func:`reduce_loss_dicts` turns the list into
the step's ``loss_dict`` as Megatron-Bridge's ``train_step`` does: a 2-element value
``[sum, count]`` is summed over micro-batches (and data-parallel ranks) and divided, a
1-element value is averaged over micro-batches.

>>> num_microbatches(global_batch_size=8, micro_batch_size=2, data_parallel_size=2)
2
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.distributed import all_reduce_sum, rank_info

#: What ``loss_func(output)`` may return, for error messages.
LOSS_PATTERNS = "(loss, loss_dict) or (loss, num_tokens, loss_dict)"


def num_microbatches(
    *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
) -> int:
    """Micro-batches per step on each rank: the global batch over micro-batch x ranks."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size ({global_batch_size}) must be a multiple of "
            f"train.micro_batch_size x data-parallel ranks ({per_step})"
        )
    return global_batch_size // per_step


def microbatches(global_state: Any) -> int:
    """Micro-batches per step on each rank, for the run's batch sizes and ranks."""
    cfg = global_state.cfg.train
    return num_microbatches(
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        data_parallel_size=rank_info()[2],
    )


def forward_passes(
    forward_step: Callable[[Iterator[Any], Any], tuple[Any, Callable[[Any], Any]]],
    data_iterator: Iterator[Any] | None,
    model: torch.nn.Module,
    count: int,
    *,
    what: str,
) -> list[dict[str, torch.Tensor]]:
    """Run ``count`` micro-batches forward (no backward); return each one's ``loss_dict``.

    ``forward_step`` takes ``(data_iterator, model)`` (the global state already bound).
    ``what`` names the iterator in the error raised when it runs out early.
    """
    loss_dicts = []
    for index in range(count):
        try:
            output, loss_func = forward_step(data_iterator, model)
        except StopIteration:
            raise ran_out_of_data(what, index, count) from None
        loss_dicts.append(split_loss(loss_func(output))[1])
    return loss_dicts


def ran_out_of_data(what: str, index: int, count: int) -> RuntimeError:
    """The error for an iterator that ended at micro-batch ``index`` (from 0) of ``count``."""
    return RuntimeError(
        f"{what} ran out of data at micro-batch {index + 1} of {count}; give an "
        "iterator that yields enough micro-batches (or lower the iteration count)"
    )


def split_loss(result: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, loss_dict)`` of one ``loss_func`` result, the loss divided by its
    ``num_tokens`` in the three-value pattern (the division by the micro-batch count is
    the Stepper's)."""
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TypeError(f"loss_func(output) must return {LOSS_PATTERNS}, got {_kind(result)}")
    loss, loss_dict = result[0], result[-1]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_func's loss must be a one-element tensor, got {_kind(loss)}")
    if not isinstance(loss_dict, dict):
        raise TypeError(f"loss_func's loss_dict must be a dict, got {_kind(loss_dict)}")
    if len(result) == 3:
        loss = loss / result[1]
    return loss.reshape(()), loss_dict


def reduce_loss_dicts(loss_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The step's losses: token-weighted for ``[sum, count]`` values, else the mean."""
    if not loss_dicts:
        return {}
    reduced = {}
    for key in loss_dicts[0]:
        values = [torch.as_tensor(d[key]).detach().reshape(-1).float() for d in loss_dicts]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            total = all_reduce_sum(total)  # [sum, count] over data-parallel ranks
            reduced[key] = total[0] / total[1]
        elif values[0].numel() == 1:
            reduced[key] = torch.cat(values).mean()
        else:
            raise ValueError(
                f"loss_dict[{key!r}] must hold 1 value (a mean) or 2 values ([sum, count]), "
                f"got shape {tuple(values[0].shape)}"
            )
    return reduced


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__
