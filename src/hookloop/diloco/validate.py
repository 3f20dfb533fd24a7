"""Whether a worker's pseudo-gradient may touch the global model.

The server calls :func:`check_contribution` on every submission before it is
averaged in, so one bad worker (another model, a NaN, a wrong dtype) is
refused with a reason instead of corrupting the model for everyone. Further
checks belong here, in this one place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

#: dtypes a pseudo-gradient may travel in (real floating point: a complex value would lose
#: its imaginary part, an integer one could hold anything up to 2**63).
ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: The largest magnitude a pseudo-gradient value may have. It is a difference of weights
#: after one period of local steps; a value beyond this is a broken worker, and a mean of
#: values within it cannot overflow the float32 global weights.
MAX_ABS_VALUE = 1e6


def _sample(names: set[str]) -> str:
    shown = sorted(names)[:5]
    return f"{shown}{'...' if len(names) > 5 else ''}"


def check_contribution(
    worker_id: str,
    tensors: Mapping[str, torch.Tensor],
    globals_: Mapping[str, torch.Tensor],
    *,
    fragment: int | None = None,
) -> str | None:
    """An error message when ``tensors`` cannot be applied to ``globals_``, else None.

    A full-model submission must name every global parameter; a fragment's
    (``fragment`` given) a non-empty subset. Tensors must be dense, shapes match,
    dtypes be real floating point (:data:`ALLOWED_DTYPES`), values finite and at
    most :data:`MAX_ABS_VALUE` in magnitude.
    """
    sent, known = set(tensors), set(globals_)
    what = (
        f"fragment {fragment} from worker {worker_id}"
        if fragment is not None
        else (f"pseudo-gradients from worker {worker_id}")
    )
    if fragment is None and sent != known:
        missing, extra = known - sent, sent - known
        return (
            f"parameter name mismatch in {what}: missing {len(missing)} {_sample(missing)}, "
            f"unexpected {len(extra)} {_sample(extra)}; the worker runs another model"
        )
    if fragment is not None and (not sent or sent - known):
        unknown = sent - known
        return (
            f"{what} has {len(unknown)} unknown parameter names {_sample(unknown)}"
            if sent
            else f"{what} is empty"
        ) + "; the worker runs another model"
    for name, value in tensors.items():
        if value.layout != torch.strided:
            return f"{what}: {name} is a {value.layout} tensor; send a dense (strided) one"
        want = tuple(globals_[name].shape)
        if tuple(value.shape) != want:
            return f"{what}: {name} has shape {tuple(value.shape)}, the server's is {want}"
        if value.dtype not in ALLOWED_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in ALLOWED_DTYPES)
            return f"{what}: {name} has dtype {value.dtype}; allowed: {allowed}"
        if not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            return f"{what}: {name} holds {bad} NaN or infinite values; all must be finite"
        if value.numel() and float(value.abs().max()) > MAX_ABS_VALUE:
            return (
                f"{what}: {name} holds a value of magnitude {float(value.abs().max()):.3g}; "
                f"allowed: at most {MAX_ABS_VALUE:g}"
            )
    return None


def check_same_names(
    worker_id: str, fragment: int, names: set[str], others: set[str]
) -> str | None:
    """An error message when a fragment names other parameters than the round's first."""
    if names == others:
        return None
    return (
        f"fragment {fragment} from worker {worker_id} names {len(names)} parameters "
        f"{_sample(names)}, the round's other submissions {len(others)} {_sample(others)}; "
        "every worker must cut the model into the same fragments (num_fragments)"
    )


def norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together (computed per tensor in float32)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in tensors))


def check_update_ratio(
    worker_id: str,
    tensors: Mapping[str, torch.Tensor],
    weights_norm: float,
    limit: float | None,
    *,
    fragment: int | None = None,
) -> str | None:
    """An error message when ``tensors``' norm is more than ``limit`` times ``weights_norm``
    (the norm of all global weights); None when within, or ``limit`` is None or 0, or the
    global weights are all zero (nothing to compare with)."""
    if not limit or weights_norm <= 0:
        return None
    ratio = norm(tensors.values()) / weights_norm
    if ratio <= limit:
        return None
    what = f"fragment {fragment} from worker {worker_id}" if fragment is not None else (
        f"pseudo-gradients from worker {worker_id}"
    )  # fmt: skip
    return (
        f"{what}: its norm is {ratio:.3g} x the global weights' norm ({weights_norm:.3g}); "
        f"allowed: at most {limit:g} x (max_update_ratio): the worker has diverged"
    )
