"""Whether a worker's pseudo-gradient may touch the global model.

The server calls :func:`check_contribution` on every submission before it is
averaged in, so one bad worker (another model, a NaN, a wrong dtype) is
refused with a reason instead of corrupting the model for everyone. Further
checks belong here, in this one place.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: dtypes a pseudo-gradient may travel in.
ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
    (``fragment`` given) a non-empty subset. Shapes must match, dtypes be
    floating, values finite.
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
        want = tuple(globals_[name].shape)
        if tuple(value.shape) != want:
            return f"{what}: {name} has shape {tuple(value.shape)}, the server's is {want}"
        if value.dtype not in ALLOWED_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in ALLOWED_DTYPES)
            return f"{what}: {name} has dtype {value.dtype}; allowed: {allowed}"
        if not bool(torch.isfinite(value).all()):
            return f"{what}: {name} holds NaN or infinite values"
    return None
