"""Run the seed documents' code examples as written, without copying them here.

The seeds (``shared/seeds/NNN_*.txt`` beside the repository) are the
specification; their examples are code that nobody on this project wrote. The
dialect tests cut an example out of the seed text at run time, between two
marker lines, swap only its import lines, and execute it. When the seeds are not
on this machine (set ``HOOKLOOP_SEEDS`` to their folder) those tests skip and say
so; every dialect also has tests of its own that always run.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parent.parent


def seeds_dir() -> Path | None:
    """``$HOOKLOOP_SEEDS``, else the first ``shared/seeds`` found beside the repo or above it."""
    env = os.environ.get("HOOKLOOP_SEEDS")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for parent in [_REPO, *_REPO.parents]:
        candidate = parent / "shared" / "seeds"
        if candidate.is_dir():
            return candidate
    return None


def seed_text(number: str) -> str:
    """The text of seed ``number`` (``"000"``, ``"001"`` …); skips the test if it is absent."""
    folder = seeds_dir()
    if folder is None:
        pytest.skip("seed documents not found: set HOOKLOOP_SEEDS to the shared/seeds folder")
    matches = sorted(folder.glob(f"{number}_*.txt"))
    if not matches:
        pytest.skip(f"seed {number} not found in {folder}")
    return matches[0].read_text(encoding="utf-8")


def example(number: str, first: str, last: str, *, occurrence: int = 1) -> str:
    """Lines of seed ``number`` from the line ``first`` through the line ``last`` (both stripped).

    ``occurrence`` picks the n-th line equal to ``first``. The block is dedented
    so that it can be executed.
    """
    lines = seed_text(number).splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == first.strip()]
    if len(starts) < occurrence:
        raise LookupError(f"seed {number} has {len(starts)} lines {first!r}, wanted {occurrence}")
    start = starts[occurrence - 1]
    for end in range(start, len(lines)):
        if lines[end].strip() == last.strip():
            return textwrap.dedent("\n".join(lines[start : end + 1])) + "\n"
    raise LookupError(f"seed {number}: no line {last!r} after {first!r}")


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
