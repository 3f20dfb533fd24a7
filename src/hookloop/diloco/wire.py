"""What travels between a DiLoCo worker and its server, in Forgather's encoding.

Tensors travel as one ``torch.save`` of a ``{name: tensor}`` dict, read back by
:func:`hookloop.safeload.load` so that a body from the network can hold tensors
and plain containers but never code, and cannot inflate: every zip entry must be
stored uncompressed, so the tensors take no more memory than the body (already
capped: ``max_payload_mb`` on the server), and a caller may cap it lower with
``max_bytes``. A pseudo-gradient
submission is a 4-byte big-endian header length, a JSON header (the worker's
id, the fragment's id) and then such a state dict. Forgather's workers and
servers use exactly this, so either side can talk to the other's.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Mapping
from typing import Any

import torch

from hookloop.safeload import RefusedFile, load

#: The media type of a tensor body (Forgather sends and expects this).
TENSOR_TYPE = "application/octet-stream"
_LENGTH = struct.Struct("!I")
_MAX_HEADER = 64 * 1024


def save_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """``{name: tensor}`` as the bytes of one ``torch.save`` (on the CPU)."""
    buf = io.BytesIO()
    torch.save({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, buf)
    return buf.getvalue()


def load_tensors(body: bytes, *, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` dict in ``body``; ``ValueError`` when it is anything else,
    or when the body (a compressed entry, more than ``max_bytes``) could inflate."""
    try:
        data = load(body, max_bytes=max_bytes, what="the tensor payload")
    except RefusedFile as err:
        raise ValueError(f"not a torch.save'd state dict: {err.reason}") from None
    except Exception as err:  # torch raises several types on bad input
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ValueError(f"not a torch.save'd state dict: {first}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise ValueError("the tensor payload must be a dict of parameter name -> tensor")
    return data


def pack(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A submission body: length-prefixed JSON ``header``, then the tensors."""
    head = json.dumps(dict(header)).encode("utf-8")
    return _LENGTH.pack(len(head)) + head + save_tensors(tensors)


def unpack(
    body: bytes, *, max_bytes: int | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(header, tensors)`` of a submission body; ``ValueError`` naming what is wrong
    (``max_bytes`` caps the tensors, as in :func:`load_tensors`)."""
    if len(body) < _LENGTH.size:
        raise ValueError("the body must start with a 4-byte big-endian JSON header length")
    (size,) = _LENGTH.unpack_from(body)
    if size > min(_MAX_HEADER, len(body) - _LENGTH.size):
        raise ValueError(
            f"the header length {size} is more than the body holds or {_MAX_HEADER} bytes"
        )
    try:
        header = json.loads(body[_LENGTH.size : _LENGTH.size + size].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("the header must be a UTF-8 JSON object") from None
    if not isinstance(header, dict):
        raise ValueError("the header must be a JSON object")
    return header, load_tensors(body[_LENGTH.size + size :], max_bytes=max_bytes)


def split_fragments(names: list[str], count: int) -> list[list[str]]:
    """Cut parameter ``names`` (model order) into ``count`` contiguous groups by count.

    The first ``len(names) % count`` groups get one name more, as Forgather's
    ``FragmentManager`` cuts them, so mixed workers agree on every fragment.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_fragments must be an int >= 1, got {count!r}")
    if count > len(names):
        raise ValueError(
            f"num_fragments ({count}) is more than the model's {len(names)} parameter tensors"
        )
    base, extra = divmod(len(names), count)
    groups, start = [], 0
    for k in range(count):
        size = base + (1 if k < extra else 0)
        groups.append(names[start : start + size])
        start += size
    return groups


def fragment_due(local_step: int, sync_every: int, count: int) -> int | None:
    """The fragment due at ``local_step`` (1-based) of a period, or None (Forgather's rule:
    fragment k at every multiple of ``sync_every // count``, in turn)."""
    interval = max(1, sync_every // count)
    if local_step <= 0 or local_step % interval:
        return None
    return (local_step // interval - 1) % count
