"""Find the largest batch that fits in memory by running, shrinking on out-of-memory.

``find_executable_batch_size(function, starting_batch_size)`` calls
``function(batch_size)``; when it fails for want of memory, the memory held by the
failed attempt is released and ``function`` runs again from its beginning with a
smaller batch, until one fits or the batch would be 0. Each retry starts over:
``function`` must set up everything that depends on the batch size itself.

What counts as out of memory is what accelerate counts: ``torch.OutOfMemoryError``,
and a ``RuntimeError`` whose one message names an out-of-memory condition of CUDA,
MPS, the CPU allocator or cuDNN. Any other error is the caller's and passes through.

The next size is ``shrink(size)``: by default ``int(size * 0.9)``, the step accelerate
takes (and so transformers' ``auto_find_batch_size``); ``halve`` is the other common
choice.

>>> tried = []
>>> def run(batch_size):
...     tried.append(batch_size)
...     if batch_size > 5:
...         raise torch.OutOfMemoryError("CUDA out of memory.")
...     return batch_size
>>> find_executable_batch_size(run, 8), tried
(5, [8, 7, 6, 5])
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = [
    "NoBatchSizeFits",
    "find_executable_batch_size",
    "halve",
    "is_out_of_memory",
    "shrink_by_tenth",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Messages of a ``RuntimeError`` that mean "out of memory" (accelerate's list).
OUT_OF_MEMORY_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN gives up on a batch too large
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


class NoBatchSizeFits(RuntimeError):
    """Even a batch of 1 ran out of memory."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says the device (or the host) ran out of memory."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError) and len(error.args) == 1 and isinstance(error.args[0], str):
        return any(message in error.args[0] for message in OUT_OF_MEMORY_MESSAGES)
    return False


def shrink_by_tenth(size: int) -> int:
    """accelerate's step: 90% of ``size``, rounded down."""
    return int(size * 0.9)


def halve(size: int) -> int:
    return size // 2


def free_memory() -> None:
    """Release what a failed attempt left: unreachable objects, then CUDA's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(
    function: Callable[[int], T],
    starting_batch_size: int,
    *,
    shrink: Callable[[int], int] = shrink_by_tenth,
) -> T:
    """``function(batch_size)`` with the largest batch from ``starting_batch_size`` down
    (by ``shrink``) that does not run out of memory; what it returns."""
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int):
        raise TypeError(f"starting_batch_size must be an int, got {starting_batch_size!r}")
    if starting_batch_size < 1:
        raise ValueError(f"starting_batch_size must be >= 1, got {starting_batch_size}")
    size = starting_batch_size
    free_memory()
    while True:
        try:
            return function(size)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
        free_memory()  # the error, and the failed attempt's tensors it held, are gone now
        smaller = min(shrink(size), size - 1)  # always smaller, so the search ends
        if smaller < 1:
            raise NoBatchSizeFits(
                f"no batch size fits in memory: a batch of {size} ran out of memory "
                f"(started at {starting_batch_size})"
            )
        log.info("a batch of %d ran out of memory; trying %d", size, smaller)
        size = smaller
