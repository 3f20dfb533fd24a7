"""The parts of Megatron-Bridge's training loop that act on Megatron-Core objects only.

Megatron-Core's ``DistributedDataParallel`` wrapper gathers parameters for its
distributed optimizer in a forward pre-hook, and its mxfp8 optimizers share a buffer
between parameters and gradients. Plain torch models and optimizers have neither:

- :func:`should_disable_forward_pre_hook` is pure logic and answers as Megatron-Bridge;
- :func:`enable_forward_pre_hook` / :func:`disable_forward_pre_hook` call the chunk's
  own method where it has one (a Megatron-Core DDP chunk) and do nothing for a plain
  torch module, which has no such hook;
- :func:`handle_mxfp8_param_buffer_copy` refreshes Megatron-Core's distributed
  optimizers only, and copies nothing for a torch optimizer: its parameters are their
  own buffer, there is no separate copy to refresh.

>>> should_disable_forward_pre_hook(False, True, True)
True
>>> enable_forward_pre_hook([torch.nn.Linear(2, 2)])  # a plain module: nothing to enable
"""

from __future__ import annotations

import sys
from typing import Any

import torch

#: Where Megatron-Core defines the distributed optimizer that keeps an mxfp8 buffer.
DISTRIBUTED_OPTIMIZER_MODULE = "megatron.core.optimizer.distrib_optimizer"


def should_disable_forward_pre_hook(
    use_megatron_fsdp: bool, use_distributed_optimizer: bool, overlap_param_gather: bool
) -> bool:
    """Whether the forward pre-hooks must be off while checkpointing: with a distributed
    optimizer that overlaps its parameter gather (and no Megatron FSDP)."""
    for name, value in (
        ("use_megatron_fsdp", use_megatron_fsdp),
        ("use_distributed_optimizer", use_distributed_optimizer),
        ("overlap_param_gather", overlap_param_gather),
    ):
        _check_bool(name, value)
    return not use_megatron_fsdp and use_distributed_optimizer and overlap_param_gather


def enable_forward_pre_hook(model: list[Any]) -> None:
    """Turn each chunk's parameter-gather pre-hook on (a no-op for plain torch modules)."""
    for chunk in check_chunks(model):
        hook = getattr(chunk, "enable_forward_pre_hook", None)
        if hook is not None:
            hook()


def disable_forward_pre_hook(model: list[Any], param_sync: bool = True) -> None:
    """Turn each chunk's parameter-gather pre-hook off, syncing parameters first when
    ``param_sync`` (a no-op for plain torch modules)."""
    _check_bool("param_sync", param_sync)
    for chunk in check_chunks(model):
        hook = getattr(chunk, "disable_forward_pre_hook", None)
        if hook is not None:
            hook(param_sync=param_sync)


def handle_mxfp8_param_buffer_copy(
    optimizer: Any, reuse_grad_buf_for_mxfp8_param_ag: bool, overlap_param_gather: bool
) -> None:
    """Refresh the mxfp8 parameter buffer that shares memory with the gradients.

    Only Megatron-Core's ``DistributedOptimizer`` instances (inside a chained optimizer)
    keep such a buffer; each one is refreshed when both flags are set, and any other
    optimizer is left alone, whatever methods it has. A torch optimizer has none, so
    nothing is copied.
    """
    _check_bool("reuse_grad_buf_for_mxfp8_param_ag", reuse_grad_buf_for_mxfp8_param_ag)
    _check_bool("overlap_param_gather", overlap_param_gather)
    distributed = _distributed_optimizer_class()
    if distributed is None or not (reuse_grad_buf_for_mxfp8_param_ag and overlap_param_gather):
        return
    for inner in getattr(optimizer, "chained_optimizers", ()):
        if isinstance(inner, distributed):
            inner._copy_main_params_to_param_buffer()


def _distributed_optimizer_class() -> type | None:
    """Megatron-Core's ``DistributedOptimizer`` class, or None when its module is not loaded.

    Read from the loaded modules, not imported: an instance can only exist once its
    module has been imported, so without it there is nothing to refresh.
    """
    module = sys.modules.get(DISTRIBUTED_OPTIMIZER_MODULE)
    found = getattr(module, "DistributedOptimizer", None)
    return found if isinstance(found, type) else None


def check_chunks(model: Any) -> list[torch.nn.Module]:
    """``model`` as Megatron-Bridge passes it: a list of model chunks (torch modules)."""
    if not isinstance(model, (list, tuple)) or not model:
        raise TypeError(
            f"model must be a non-empty list of model chunks (torch modules), got {_kind(model)}"
        )
    for chunk in model:
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(
                f"model must be a list of torch modules, but it holds a {type(chunk).__name__}"
            )
    return list(model)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _kind(value: object) -> str:
    if isinstance(value, (list, tuple)) and not value:
        return "an empty list"
    return f"a {type(value).__name__}"


def check_nvrx_straggler_detection(nvrx_straggler_manager: Any) -> bool:
    """Whether NVRx's straggler detection asks the run to stop: never without a manager
    (the dialect makes none); a manager given is asked for this rank."""
    if nvrx_straggler_manager is None:
        return False
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return bool(nvrx_straggler_manager.check_stragglers(rank))


def chunk_device(model: list[Any]) -> torch.device:
    """The device of the first parameter of ``model``'s first chunk (CPU without one)."""
    first = next(model[0].parameters(), None) if model else None
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
