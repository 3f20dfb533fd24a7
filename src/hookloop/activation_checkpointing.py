"""Activation checkpointing: chosen submodules keep only their inputs for the backward
pass and run their forward again to get the rest, trading compute for memory.

``wrap_for_checkpointing(model, module_types)`` replaces the ``forward`` of every
submodule of ``model`` that is an instance of one of ``module_types`` (a transformer
block, say) with one that runs the original under ``torch.utils.checkpoint.checkpoint``
(``use_reentrant=False``: gradients reach parameters and inputs alike, and keyword
arguments pass through). The loss and the gradients are the ones the model gives
without it; with dropout, the recomputation replays the same random draws (torch's
``preserve_rng_state``, on by default).

Only modules in training mode are checkpointed: in evaluation nothing is kept for a
backward pass anyway. ``unwrap`` undoes it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_by_name", "unwrap", "wrap_for_checkpointing"]

#: The attribute a wrapped module keeps its own ``forward`` under.
_ORIGINAL = "hookloop_forward_before_checkpointing"


def wrap_for_checkpointing(
    model: torch.nn.Module, module_types: type | Iterable[type], **kwargs: Any
) -> list[torch.nn.Module]:
    """Checkpoint every submodule of ``model`` (``model`` itself included) that is an
    instance of ``module_types``; ``kwargs`` go to ``torch.utils.checkpoint.checkpoint``
    (``use_reentrant`` is always False). Returns the modules wrapped, outermost first; a
    module inside one already wrapped is left alone (its outer one recomputes it)."""
    types = (module_types,) if isinstance(module_types, type) else tuple(module_types)
    if not types or not all(isinstance(t, type) for t in types):
        raise TypeError(f"module_types must be module classes, got {module_types!r}")
    if kwargs.get("use_reentrant", False):
        raise ValueError("wrap_for_checkpointing runs checkpoint with use_reentrant=False only")
    kwargs = {**kwargs, "use_reentrant": False}
    wrapped: list[torch.nn.Module] = []
    for module in model.modules():
        if not isinstance(module, types) or _inside_any(module, wrapped):
            continue
        if _ORIGINAL not in vars(module):
            setattr(module, _ORIGINAL, module.forward)
            module.forward = functools.partial(_checkpointed_forward, module, kwargs)
        wrapped.append(module)
    if not wrapped:
        names = ", ".join(t.__name__ for t in types)
        raise ValueError(f"{type(model).__name__} has no submodule of type {names} to checkpoint")
    return wrapped


def checkpoint_by_name(model: torch.nn.Module, names: str) -> list[torch.nn.Module]:
    """``train.activation_checkpointing``: checkpoint the submodules whose class is named in
    ``names`` (comma-separated); a name no submodule has is one line listing those it has."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in wanted if n not in present]
    if missing:
        from hookloop.errors import ConfigError

        raise ConfigError(
            f"train.activation_checkpointing names {', '.join(missing)}, which "
            f"{type(model).__name__} has no submodule of; its classes: {', '.join(sorted(present))}"
        )
    return wrap_for_checkpointing(model, [present[n] for n in wanted])


def unwrap(model: torch.nn.Module) -> None:
    """Give every checkpointed submodule of ``model`` its own ``forward`` back."""
    for module in model.modules():
        if _ORIGINAL in vars(module):
            del module.forward  # the instance attribute: the class's forward shows again
            delattr(module, _ORIGINAL)


def _inside_any(module: torch.nn.Module, outer: list[torch.nn.Module]) -> bool:
    return any(module is not o and any(module is m for m in o.modules()) for o in outer)


def _checkpointed_forward(
    module: torch.nn.Module, options: dict[str, Any], *args: Any, **kwargs: Any
) -> Any:
    forward = getattr(module, _ORIGINAL)
    if not (module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, **options, **kwargs)
