"""Giving a forward step the run's ``GlobalState`` when it asks for it, as Megatron-Bridge.

A forward step asks for the state by its first parameter: annotated ``GlobalState``
(any parameter so annotated counts) or, unannotated, named ``state`` or
``global_state``. Steps taking ``(data_iterator, model)`` or ``(data_iterator, model,
return_schedule_plan)`` get no state. Functors (objects with ``__call__``) are read
through their ``__call__``.

>>> def step(state, data_iterator, model):
...     return state
>>> maybe_inject_state(step, "the state")(iter([]), None)
'the state'
>>> needs_global_state_injection(lambda data_iterator, model: None)
False

:func:`prepare_forward_step_func` decides once and binds (what a loop calls before its
first step); :func:`param_is_not_shared` reads Megatron's ``shared`` mark on a parameter
(set on embeddings tied across pipeline stages), so norms count a shared one once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

#: Unannotated first-parameter names that ask for the state.
STATE_NAMES = ("state", "global_state")


def needs_global_state_injection(forward_step_func: Callable[..., Any]) -> bool:
    """Whether ``forward_step_func`` takes the ``GlobalState`` as its first argument."""
    try:
        params = list(inspect.signature(forward_step_func).parameters.values())
    except (TypeError, ValueError):  # no signature to read: assume it takes none
        return False
    for param in params:
        annotation = param.annotation
        name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        if name.rpartition(".")[2] == "GlobalState":
            return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return bool(positional) and positional[0].name in STATE_NAMES


def maybe_inject_state(
    forward_step_func: Callable[..., Any], state: Any, needs_injection: bool | None = None
) -> Callable[..., Any]:
    """``forward_step_func`` with ``state`` bound first when it asks for it, else itself.

    ``needs_injection`` skips the signature inspection (a loop decides it once).
    """
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return functools.partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(
    forward_step_func: Callable[..., Any], state: Any
) -> Callable[..., Any]:
    """``forward_step_func`` ready for the loop: ``state`` bound first when it asks for it.

    The signature is read once here; the bound step holds ``state`` itself, not a copy,
    so it sees every later change to the state (the step counter, the config).
    """
    return maybe_inject_state(
        forward_step_func, state, needs_injection=needs_global_state_injection(forward_step_func)
    )


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for a parameter marked ``shared = True`` (counted on another stage), else True."""
    return not getattr(param, "shared", False)
