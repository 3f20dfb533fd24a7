"""What travels between a DiLoCo worker and its server: safetensors payloads.

A payload is one safetensors file in memory: named tensors plus a small
string-to-string metadata header (rounds, worker id, speeds). safetensors
reads no code, so a payload from the network cannot execute anything.
Pseudo-gradients may travel as bfloat16 (half the bytes); weights always
travel in their own dtype so no precision is lost on the global model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import load as _load
from safetensors.torch import save as _save

#: The media type of a payload body.
CONTENT_TYPE = "application/vnd.hookloop.safetensors"


def encode(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any] | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> bytes:
    """One payload; ``meta`` values are JSON-encoded; ``dtype`` casts floating tensors."""
    out = {}
    for name, t in tensors.items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous().cpu()
    header = {k: json.dumps(v) for k, v in (meta or {}).items()}
    return _save(out, metadata=header)


def decode(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, meta)`` of a payload; ``ValueError`` when it is not one."""
    try:
        tensors = _load(body)
        header = _read_metadata(body)
    except Exception as err:  # safetensors raises its own error types on bad input
        raise ValueError(f"not a safetensors payload: {err}") from None
    return tensors, {k: json.loads(v) for k, v in header.items()}


def _read_metadata(body: bytes) -> dict[str, str]:
    if len(body) < 8:
        raise ValueError("payload shorter than its 8-byte header length")
    size = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + size])
    return dict(header.get("__metadata__", {}))


def split_fragments(sizes: Sequence[tuple[str, int]], count: int) -> list[list[str]]:
    """Cut the parameters, in model order, into ``count`` contiguous groups of similar size.

    Both sides call this with the same ``(name, numel)`` list, so they agree on
    which parameters form fragment *k* without sending the partition around.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_fragments must be an int >= 1, got {count!r}")
    if count > len(sizes):
        raise ValueError(
            f"num_fragments={count} is more than the model's {len(sizes)} parameter tensors"
        )
    total = sum(n for _, n in sizes)
    groups: list[list[str]] = [[] for _ in range(count)]
    seen = 0
    for i, (name, numel) in enumerate(sizes):
        left = len(sizes) - i  # tensors still to place, this one included
        k = min(count - 1, seen * count // max(total, 1))
        # Leave at least one tensor for every later fragment, and never skip a fragment.
        k = max(k, count - left)
        k = min(k, next((j for j, g in enumerate(groups) if not g), count - 1))
        groups[k].append(name)
        seen += numel
    return groups
