"""Rank helpers and the agreement of control decisions across ranks.

Every decision that changes control flow (stop, abort, save, evaluate, log,
skip) is computed locally, agreed with one small collective, then acted on by
every rank alike, so no rank waits forever in a collective the others skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_info() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` of this process (``(0, 0, 1)`` when alone)."""
    if is_distributed():
        return dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), dist.get_world_size()
    return 0, 0, 1


def rank_zero_only(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Run ``fn`` on rank 0 only (files, printing, servers); other ranks get None."""

    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        if rank_info()[0] == 0:
            return fn(*args, **kwargs)
        return None

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def agree_flags(flags: list[int], device: torch.device) -> list[int]:
    """Element-wise OR of small integer flags over all ranks (max for codes)."""
    if not is_distributed():
        return flags
    t = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
