"""Forgather's built-ins keep every import path they had when they were one module.

``hookloop.compat.forgather.callbacks`` is a package with a module per callback; the
names below were importable from it as a single module, and objects pickled then name
it as their module, so those pickles must still load.
"""

from __future__ import annotations

import importlib
import json
import pickle
import warnings
from types import SimpleNamespace

import pytest

import hookloop.compat.forgather as forgather
import hookloop.compat.forgather.callbacks as callbacks

#: What ``hookloop.compat.forgather.callbacks`` offered as one module, besides its __all__.
SUPPORT = (
    "DEFAULT_FINAL_METRICS",
    "DEFAULT_GENERATION",
    "DEFAULT_TB_SCALARS",
    "JsonArrayFile",
    "default_tb_scalars",
    "format_final_metrics",
    "get_perplexity",
    "log",
    "read_json_log",
    "resolve_final_metrics",
    "resolve_tb_scalars",
)


def test_every_name_is_importable_from_the_package_and_is_the_one_forgather_exports():
    for name in (*callbacks.__all__, *SUPPORT):
        assert hasattr(callbacks, name), name
    for name in callbacks.__all__:
        assert getattr(forgather, name) is getattr(callbacks, name), name
    assert callbacks.DualWindowDivergenceDetector is callbacks.DivergenceDetector


@pytest.mark.parametrize(
    "shim", ["hookloop.compat.hf.seed004", "hookloop.compat.hf.seed004_diloco"]
)
def test_the_deprecated_paths_give_the_same_classes(shim):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(shim)
    for name in module.__all__:
        assert getattr(module, name) is getattr(callbacks, name), name


def _as_one_module(stream: bytes) -> bytes:
    """A protocol-0 pickle rewritten to name the classes as the single module did."""
    for sub in ("jsonlog", "divergence"):
        stream = stream.replace(f"callbacks.{sub}\n".encode(), b"callbacks\n")
    assert b"callbacks.jsonlog" not in stream and b"callbacks\nJsonLogger\n" in stream
    return stream


def test_a_pickle_naming_the_single_module_loads_and_keeps_working(tmp_path):
    logger, detector = callbacks.JsonLogger(project="x"), callbacks.DivergenceDetector(patience=5)
    logger_copy, detector_copy = pickle.loads(_as_one_module(pickle.dumps([logger, detector], 0)))

    assert type(logger_copy) is callbacks.JsonLogger and logger_copy.kwargs == {"project": "x"}
    assert type(detector_copy) is callbacks.DivergenceDetector
    assert detector_copy.state_dict() == detector.state_dict()
    args = SimpleNamespace(logging_dir=str(tmp_path))
    state = SimpleNamespace(is_world_process_zero=True, global_step=1, epoch=0.5)
    logger_copy.on_train_begin(args, state, None)
    logger_copy.on_log(args, state, None, logs={"loss": 2.0})
    logger_copy.on_train_end(args, state, None)
    records = json.loads((tmp_path / "trainer_logs.json").read_text(encoding="utf-8"))
    assert [(r["global_step"], r["loss"]) for r in records] == [(1, 2.0)]
