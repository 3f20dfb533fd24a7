"""Files a newcomer can read top to bottom: no module over :data:`MAX_FILE_LINES` lines,
no function over :data:`MAX_FUNCTION_LINES` lines.

Read from the source with :mod:`ast` (nothing is imported). A function's length runs
from its first decorator to its last line, docstring and nested functions included.
The rule covers all of ``src/``; :data:`NOT_YET` names the files still over it, each
with why, and may only shrink: a listed file that comes within the limits must leave it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: The folders under ``src/`` held to the limits (every ``.py`` file below each).
CHECKED = ("hookloop",)

#: Files still over a limit, and why; none may be added.
NOT_YET = {}

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _files() -> list[Path]:
    files = []
    for folder in CHECKED:
        root = SRC / folder
        assert root.is_dir(), f"{root} is no folder: update CHECKED"
        files += sorted(root.rglob("*.py"))
    return [f for f in files if f.relative_to(SRC).as_posix() not in NOT_YET]


def _over(path: Path) -> bool:
    source = path.read_text(encoding="utf-8")
    return len(source.splitlines()) > MAX_FILE_LINES or bool(
        _long_functions(ast.parse(source), MAX_FUNCTION_LINES)
    )


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


def test_the_files_not_yet_within_the_limits_are_still_over_them():
    within = [name for name in NOT_YET if (SRC / name).is_file() and not _over(SRC / name)]
    gone = [name for name in NOT_YET if not (SRC / name).is_file()]
    assert not within, f"within the limits now: remove them from NOT_YET: {within}"
    assert not gone, f"no such file: remove them from NOT_YET: {gone}"
