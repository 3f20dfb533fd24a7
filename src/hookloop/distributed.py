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
    """Sum over ranks (a copy; the input is unchanged)."""
    if is_distributed():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a copy)."""
    if is_distributed():
        return all_reduce_sum(value) / dist.get_world_size()
    return value


def init_from_env() -> bool:
    """Join the process group torchrun describes in the environment (once).

    Uses nccl when CUDA is available, gloo otherwise. Returns whether this
    process is part of a group of more than one.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or is_distributed():
        return is_distributed()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    return True


def wrap_data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP-wrap ``model`` when there is more than one rank; otherwise return it as is."""
    from torch.nn.parallel import DistributedDataParallel

    if not is_distributed() or dist.get_world_size() == 1:
        return model
    if isinstance(model, DistributedDataParallel):
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a list indexed by rank) on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
