"""Run the compatible systems' own documentation examples as written, without copying them.

The documents each compatible system publishes about its callbacks and training
entry points are the specification; their examples are code that nobody on this
project wrote. They sit beside the repository, one text file each
(``shared/seeds/<NNN>_*.txt``, numbered as :data:`DOCUMENTS` says). The dialect
tests cut an example out of a document at run time, between two marker lines, swap
only its import lines, and execute it. When the documents are not on this machine
(set ``HOOKLOOP_REFERENCE_DOCS`` to their folder) those tests skip and say so; every
dialect also has tests of its own that always run.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parent.parent

#: Each document, by the system and the part of it it describes -> its file's number.
DOCUMENTS = {
    "megatron_bridge_callbacks": "000",
    "hpo_trainer_callbacks": "001",
    "megatron_bridge_entry_points": "002",
    "megatron_bridge_train": "003",
    "forgather_callbacks": "004",
}


def documents_dir() -> Path | None:
    """``$HOOKLOOP_REFERENCE_DOCS``, else the first ``shared/seeds`` beside the repo or above."""
    env = os.environ.get("HOOKLOOP_REFERENCE_DOCS") or os.environ.get("HOOKLOOP_SEEDS")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for parent in [_REPO, *_REPO.parents]:
        candidate = parent / "shared" / "seeds"
        if candidate.is_dir():
            return candidate
    return None


def document_text(document: str) -> str:
    """The text of ``document`` (a key of :data:`DOCUMENTS`); skips the test if it is absent."""
    if document not in DOCUMENTS:
        raise KeyError(f"unknown document {document!r}; the documents are {sorted(DOCUMENTS)}")
    number = DOCUMENTS[document]
    folder = documents_dir()
    if folder is None:
        pytest.skip(
            "the compatible systems' documents were not found: set HOOKLOOP_REFERENCE_DOCS "
            "to their folder"
        )
    matches = sorted(folder.glob(f"{number}_*.txt"))
    if not matches:
        pytest.skip(f"document {document} ({number}_*.txt) not found in {folder}")
    return matches[0].read_text(encoding="utf-8")


def example(document: str, first: str, last: str, *, occurrence: int = 1) -> str:
    """Lines of ``document`` from the line ``first`` through the line ``last`` (both stripped).

    ``occurrence`` picks the n-th line equal to ``first``. The block is dedented
    so that it can be executed.
    """
    lines = document_text(document).splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == first.strip()]
    if len(starts) < occurrence:
        raise LookupError(f"{document} has {len(starts)} lines {first!r}, wanted {occurrence}")
    start = starts[occurrence - 1]
    for end in range(start, len(lines)):
        if lines[end].strip() == last.strip():
            return textwrap.dedent("\n".join(lines[start : end + 1])) + "\n"
    raise LookupError(f"{document}: no line {last!r} after {first!r}")


def with_imports(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each import line that starts with a key replaced by its value.

    Only lines starting with ``import`` or ``from`` are touched, and each key
    must match at least one, so an example can never run half-translated.
    """
    out, used = [], set()
    for line in code.splitlines():
        stripped = line.lstrip()
        hit = next((k for k in replacements if stripped.startswith(k)), None)
        if hit is not None and stripped.startswith(("import ", "from ")):
            indent = line[: len(line) - len(stripped)]
            out.append(indent + replacements[hit])
            used.add(hit)
        else:
            out.append(line)
    missing = set(replacements) - used
    if missing:
        raise LookupError(f"no import line starts with {sorted(missing)}")
    return "\n".join(out) + "\n"
