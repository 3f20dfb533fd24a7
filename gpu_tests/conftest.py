"""gpu_tests/: checks that need a CUDA device, run only on a GPU machine (`pytest gpu_tests`).

The CPU suite never collects this folder (pyproject's testpaths are tests/ and
src/hookloop). hookloop is imported from this checkout's src/ when it is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("hookloop") is None:  # not installed, no PYTHONPATH: this src/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
