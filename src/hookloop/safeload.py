"""What hookloop unpickles: every ``torch.save`` file or body it reads goes through :func:`load`.

A checkpoint folder, a transformers ``checkpoint-N`` folder or a DiLoCo body may come
from someone else, so reading one must neither run code nor allocate far more than it
holds. :func:`load` checks before torch reads anything:

1. **The archive.** It must be a zip archive as ``torch.save`` writes one (the format
   since torch 1.6; the older format sizes its storages from the pickle, before any data
   is read). Its central directory is read with :mod:`zipfile`: every entry must be
   *stored* (uncompressed, as ``torch.save`` writes it), so an entry inflates to no
   more than it occupies, and the entries together may hold no more than the archive's
   own size and the caller's ``max_bytes``. A deflated entry (a zip bomb: a 1 MiB body
   that torch would inflate to 1 GiB) is refused by name.
2. **The pickle.** ``torch.load(weights_only=True)``, always: tensors, numbers, strings,
   ``None`` and containers, with torch's own allowlist. ``bytearray`` is refused too
   (torch allows it, and ``bytearray(n)`` zero-fills ``n`` bytes named by an integer in
   the pickle); no file hookloop or transformers writes holds one.
3. **NumPy arrays, only where asked** (``numpy_arrays=True``: transformers'
   ``rng_state.pth`` holds NumPy's generator state). Then exactly the four names
   transformers itself allows when it loads that file (:data:`NUMPY_ARRAY_NAMES`) are
   accepted, for the duration of this call only (``torch.serialization.safe_globals``;
   nothing is added with ``add_safe_globals``), and no module named by the file is ever
   imported. Under those names, an array can only be rebuilt the way
   ``ndarray.__reduce__`` saves it (empty, then filled from the pickle's own bytes): a
   pickle calling ``numpy.ndarray`` with a large shape is refused before it allocates.
4. **Nobody else widens it.** A name other code in the process allowed with
   ``add_safe_globals`` is still refused here.

A refusal is a :class:`RefusedFile` (a ``ValueError``) with one line naming the file (or
body) and what is allowed. A file that is damaged in another way raises torch's own
error; callers name the file in theirs.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

__all__ = ["NUMPY_ARRAY_NAMES", "RefusedFile", "load"]

Source = str | os.PathLike[str] | bytes

#: Globals torch allows by default that hookloop refuses: ``bytearray(n)`` allocates and
#: zero-fills ``n`` bytes, ``n`` being any integer in the pickle.
REFUSED_GLOBALS = frozenset({"builtins.bytearray", "__builtin__.bytearray"})

#: The function NumPy pickles an array with (``numpy._core.multiarray._reconstruct`` in
#: NumPy 2), taken from ``ndarray.__reduce__`` itself rather than by its private name.
_RECONSTRUCT = np.empty(0).__reduce__()[0]


def _dotted(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


#: The NumPy names transformers allows in ``rng_state.pth``: how an array and its dtype
#: are pickled. Nothing else of NumPy is ever unpickled.
NUMPY_ARRAY_NAMES = (
    _dotted(_RECONSTRUCT),
    _dotted(np.ndarray),
    _dotted(np.dtype),
    _dotted(type(np.dtype(np.uint32))),
)


class RefusedFile(ValueError):
    """A file or body :func:`load` will not unpickle: ``"<source>: <reason>"``, one line.

    ``reason`` alone (what was wrong and what is allowed) is for callers that name the
    source in their own words."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self) -> tuple[type[RefusedFile], tuple[str, str]]:
        return (RefusedFile, (self.source, self.reason))  # crosses process boundaries


class _SavedArray(np.ndarray):
    """What ``numpy.ndarray`` means in a pickle read here: the type of a saved array.

    Calling it is refused (``numpy.ndarray(shape, dtype)`` would allocate an array of a
    shape the pickle names); :func:`_rebuild_array` makes the empty array that
    ``ndarray.__setstate__`` then fills from the pickle's own bytes.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> _SavedArray:
        raise pickle.UnpicklingError(
            "numpy.ndarray may only be the type of a saved array, never called"
        )


def _rebuild_array(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """NumPy's ``_reconstruct`` as ``ndarray.__reduce__`` calls it, and only so."""
    if subtype is not _SavedArray or tuple(shape) != (0,):
        raise pickle.UnpicklingError(
            f"{NUMPY_ARRAY_NAMES[0]} may only rebuild a saved array, got shape {shape!r}"
        )
    return _RECONSTRUCT(_SavedArray, (0,), dtype)


def _numpy_allowlist() -> list[Any]:
    return [
        (_rebuild_array, NUMPY_ARRAY_NAMES[0]),
        (_SavedArray, NUMPY_ARRAY_NAMES[1]),
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def load(
    source: Source,
    *,
    map_location: Any = "cpu",
    max_bytes: int | None = None,
    numpy_arrays: bool = False,
    what: str | None = None,
) -> Any:
    """``torch.load(source, weights_only=True)`` after the checks in this module's docstring.

    ``source``: a path or the bytes of a body. ``max_bytes``: the most the archive may
    hold, its entries included (None: no cap but its own size, which stored entries never
    exceed). ``what`` names the source in errors (default: the path, or "the body").
    """
    name = what or (str(source) if not isinstance(source, bytes) else "the body")
    allowed = _numpy_allowlist() if numpy_arrays else []
    # Names someone else allowed process-wide (``add_safe_globals``) do not widen ours.
    others = {_global_name(g) for g in torch.serialization.get_safe_globals()}
    refused = REFUSED_GLOBALS | frozenset(others - {_global_name(g) for g in allowed})
    with _opened(source) as file:
        named = _check_archive(file, name, max_bytes, refused)
        if named:
            raise RefusedFile(name, _not_unpickled(named, numpy_arrays))
        file.seek(0)
        with torch.serialization.safe_globals(allowed):
            try:
                return torch.load(file, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as err:
                file.seek(0)
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
                if not unsafe:
                    raise RefusedFile(name, f"refused while unpickling: {_reason(err)}") from None
                raise RefusedFile(name, _not_unpickled(unsafe, numpy_arrays)) from None


@contextlib.contextmanager
def _opened(source: Source) -> Iterator[IO[bytes]]:
    if isinstance(source, bytes):
        yield io.BytesIO(source)
    else:
        with Path(source).open("rb") as file:
            yield file


def _global_name(allowed: Any) -> str:
    """The name the unpickler knows an allowlist entry by (an object or ``(obj, name)``)."""
    if isinstance(allowed, tuple):
        return str(allowed[1])
    return f"{getattr(allowed, '__module__', '')}.{getattr(allowed, '__qualname__', '')}"


def _check_archive(
    file: IO[bytes], name: str, max_bytes: int | None, refused_names: frozenset[str]
) -> set[str]:
    """Refuse ``file`` unless it is a zip archive of stored entries within the caps; return
    which of ``refused_names`` its pickle names."""
    size = file.seek(0, io.SEEK_END)
    if max_bytes is not None and size > max_bytes:
        raise RefusedFile(name, f"it is {size} bytes; at most {max_bytes} are read")
    file.seek(0)
    try:
        archive = zipfile.ZipFile(file)
        entries = archive.infolist()
    except Exception as err:  # zipfile raises several types on a torn or foreign file
        file.seek(0)
        if file.read(4) == b"PK\x03\x04":
            raise RefusedFile(name, f"a damaged or truncated zip archive ({_line(err)})") from None
        raise RefusedFile(
            name,
            f"not a torch.save zip archive ({_line(err)}); only that format "
            "(torch.save's since torch 1.6) is read",
        ) from None
    total = 0
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise RefusedFile(
                name,
                f"entry {entry.filename} is compressed ({entry.compress_size} bytes inflating "
                f"to {entry.file_size}); only entries stored uncompressed, as torch.save "
                "writes them, are read",
            )
        total += entry.file_size
    if total > size:  # stored entries cannot: the directory lies about their sizes
        raise RefusedFile(
            name,
            f"its entries claim {total} bytes, more than the archive's {size}; "
            "stored entries hold at most what the archive does",
        )
    named: set[str] = set()
    for entry in entries:
        if entry.filename.rpartition("/")[2] != "data.pkl":
            continue
        data = archive.read(entry)
        if any(refused.rpartition(".")[2].encode() in data for refused in refused_names):
            named |= _globals_in(data, name) & refused_names  # else no GLOBAL can name one
    return named


def _globals_in(data: bytes, name: str) -> set[str]:
    """The ``module.name`` of every GLOBAL in a pickle (the only way torch's
    ``weights_only`` unpickler takes a global), read without unpickling."""
    found = set()
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name == "GLOBAL":
                found.add(str(arg).replace(" ", "."))
    except Exception as err:  # pickletools raises several types on a torn pickle
        raise RefusedFile(name, f"its pickle is damaged ({_line(err)})") from None
    return found


def _not_unpickled(names: set[str] | list[str], numpy_arrays: bool) -> str:
    allowed = "tensors, numbers, strings, None and containers"
    return (
        f"it holds {', '.join(sorted(names))}, which hookloop does not unpickle "
        f"(allowed: {allowed}{', NumPy arrays' if numpy_arrays else ''})"
    )


def _reason(err: pickle.UnpicklingError) -> str:
    """The unpickler's own reason inside torch's long ``weights_only`` message."""
    _, marker, rest = str(err).partition("WeightsUnpickler error:")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    return lines[0][:200] if marker and lines else _line(err)


def _line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
