"""Files a newcomer can read top to bottom: no module over :data:`MAX_FILE_LINES` lines,
no function over :data:`MAX_FUNCTION_LINES` lines.

Read from the source with :mod:`ast` (nothing is imported). A function's length runs
from its first decorator to its last line, docstring and nested functions included.
The rule covers the folders in :data:`CHECKED`; widen it to more of ``src/`` as they
come within the limits.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: The folders under ``src/`` held to the limits (every ``.py`` file below each).
CHECKED = ("hookloop/compat/hf",)

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _files() -> list[Path]:
    files = []
    for folder in CHECKED:
        root = SRC / folder
        assert root.is_dir(), f"{root} is no folder: update CHECKED"
        files += sorted(root.rglob("*.py"))
    return files


def _long_functions(tree: ast.Module, limit: int) -> list[tuple[str, int, int]]:
    """``(name, first line, length)`` of each function or method longer than ``limit``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - first + 1
            if length > limit:
                found.append((node.name, first, length))
    return found


def test_the_measures_see_a_long_file_and_a_long_function():
    # Guards the tests below against passing because they measured nothing.
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    tree = ast.parse(f"@staticmethod\ndef long():\n{body}\n\ndef short():\n    pass\n")
    assert _long_functions(tree, MAX_FUNCTION_LINES) == [("long", 1, 63)]
    assert _long_functions(tree, 63) == []
    assert len(_files()) > 10


def test_no_file_is_over_the_line_limit():
    long = {
        path.relative_to(SRC).as_posix(): n
        for path in _files()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by concern): {long}"


def test_no_function_is_over_the_line_limit():
    long = [
        f"{path.relative_to(SRC).as_posix()}:{line} {name} ({length} lines)"
        for path in _files()
        for name, line, length in _long_functions(
            ast.parse(path.read_text(encoding="utf-8")), MAX_FUNCTION_LINES
        )
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
