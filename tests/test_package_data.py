"""Every file of the package that is not Python ships in the wheel.

setuptools puts ``.py`` files into a wheel on its own; any other file (``py.typed``, the
control dashboard's page) only when ``[tool.setuptools.package-data]`` names it. A file
left out works from a checkout and fails only once installed, so the list is checked here.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "hookloop"


def _data_files() -> list[str]:
    return sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    )


def test_every_file_that_is_not_python_is_package_data():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["hookloop"]
    files = _data_files()
    assert {"py.typed", "control/dashboard.js"} <= set(files)  # the scan sees the files
    missing = [f for f in files if not any(fnmatch.fnmatchcase(f, p) for p in patterns)]
    assert not missing, f"add them to [tool.setuptools.package-data] in pyproject.toml: {missing}"
