"""What hookloop unpickles (:mod:`hookloop.safeload`), each attack shown live first.

- A planted ``rng_state.pth`` in a transformers ``checkpoint-N`` folder runs code under a
  naive loader and under an allowlist read from the file's own names; the transformers
  dialect refuses it in one line, and nothing runs. A genuine one, written by
  transformers' own Trainer, still resumes.
- A zip bomb (a small ``torch.save`` body whose tensor entry is deflated) inflates under
  ``torch.load``; hookloop refuses it from the zip's directory before torch reads it, in
  the loader, on the DiLoCo server (400, one line) and on a worker reading an answer.
- NumPy names transformers allows cannot allocate an array of a shape the pickle names.
- No module of ``src/`` unpickles anything but through the loader.
"""

from __future__ import annotations

import ast
import http.server
import io
import json
import pickle
import shutil
import threading
import urllib.error
import urllib.request
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hookloop.compat import hf  # noqa: E402
from hookloop.diloco import storage  # noqa: E402
from hookloop.diloco.client import DiLoCoClient  # noqa: E402
from hookloop.diloco.server import DiLoCoServer  # noqa: E402
from hookloop.diloco.wire import pack, save_tensors  # noqa: E402
from hookloop.safeload import NUMPY_ARRAY_NAMES, RefusedFile, load  # noqa: E402
from test_hf_training_differential import (  # noqa: E402
    BASE,
    RegressionDataset,
    RegressionModel,
    one_thread,  # noqa: F401 - the module's autouse fixture: tiny models, one thread
)

SRC = Path(__file__).resolve().parent.parent / "src" / "hookloop"
TOKEN = "safe-load-test-token-0123456789"


def _transformers_allowlist() -> list[Any]:
    """What transformers' Trainer allows when it loads its own ``rng_state.pth``."""
    reconstruct = np.empty(0).__reduce__()[0]
    return [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


# -- a transformers checkpoint folder ------------------------------------------------------
def _trainer(kind: Any, out: Path, max_steps: int) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), **{**BASE, "max_steps": max_steps, "save_strategy": "steps",
                                "save_steps": 2, "per_device_train_batch_size": 4},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kind(RegressionModel(), args, train_dataset=RegressionDataset(16))


@pytest.fixture(scope="module")
def written_by_transformers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint-2`` as transformers' own Trainer writes it."""
    out = tmp_path_factory.mktemp("hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(transformers.Trainer, out, max_steps=2).train()
    return out / "checkpoint-2"


class _Runs:
    """Pickles as a call of ``func(*args)``: what an attacker plants."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.call = (func, args)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.call


def _writes(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')"


def _plant(folder: Path, tmp_path: Path, payload: Any) -> Path:
    """A copy of ``folder`` whose ``rng_state.pth`` holds ``payload`` beside genuine states."""
    planted = tmp_path / "planted" / folder.name
    shutil.copytree(folder, planted)
    with torch.serialization.safe_globals(_transformers_allowlist()):
        states = torch.load(folder / "rng_state.pth", weights_only=True)
    torch.save({**states, "python": payload}, planted / "rng_state.pth")
    return planted


def _runstring_payload(marker: Path) -> Any:
    from numpy.testing import runstring  # exec()s a string: numpy.testing._private.utils

    return _Runs(runstring, _writes(marker), {})


def _numpy_load_payload(marker: Path, tmp_path: Path) -> Any:
    pickled = tmp_path / "innocent.npy"  # numpy.load unpickles a non-.npy file if allowed
    pickled.write_bytes(pickle.dumps(_Runs(exec, _writes(marker))))
    return _Runs(np.load, str(pickled), None, True)


def _names_from_the_file(path: Path) -> Any:
    """The loader the report describes: every ``numpy.*`` global the file names is
    imported and allowed, then ``torch.load(weights_only=True)``."""
    import importlib

    allowed: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)):
        if name.startswith("numpy."):
            module, _, attr = name.rpartition(".")
            allowed.append(getattr(importlib.import_module(module), attr))
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


@pytest.mark.parametrize("kind", ["numpy.testing runstring", "numpy.load with pickles"])
def test_a_planted_rng_state_runs_code_naively_and_the_dialect_refuses_it(
    kind: str, written_by_transformers: Path, tmp_path: Path
):
    marker = tmp_path / "marker"
    payload = (
        _runstring_payload(marker)
        if kind.startswith("numpy.testing")
        else _numpy_load_payload(marker, tmp_path)
    )
    folder = _plant(written_by_transformers, tmp_path, payload)
    rng_file = folder / "rng_state.pth"
    for naive in (lambda path: torch.load(path, weights_only=False), _names_from_the_file):
        naive(rng_file)
        assert marker.read_text() == "ran"  # the attack is live
        marker.unlink()

    theirs = _trainer(transformers.Trainer, tmp_path / "theirs", max_steps=4)
    with warnings.catch_warnings(), pytest.raises(pickle.UnpicklingError):
        warnings.simplefilter("ignore")
        theirs.train(resume_from_checkpoint=str(folder))  # transformers refuses it too
    assert not marker.exists()

    trainer = _trainer(hf.Trainer, tmp_path / "out", max_steps=4)
    with pytest.raises(ValueError) as refused:
        trainer.train(resume_from_checkpoint=str(folder))
    message = str(refused.value)
    assert "\n" not in message and str(rng_file) in message
    assert "which hookloop does not unpickle" in message
    assert ("runstring" if kind.startswith("numpy.testing") else "numpy.load") in message
    assert not marker.exists()


def test_a_genuine_rng_state_loads_as_transformers_loads_it_and_resumes(
    written_by_transformers: Path, tmp_path: Path
):
    rng_file = written_by_transformers / "rng_state.pth"
    with torch.serialization.safe_globals(_transformers_allowlist()):
        theirs = torch.load(rng_file, weights_only=True)
    ours = load(rng_file, numpy_arrays=True)
    assert ours["python"] == theirs["python"] and torch.equal(ours["cpu"], theirs["cpu"])
    assert ours["numpy"][0] == theirs["numpy"][0] and ours["numpy"][2:] == theirs["numpy"][2:]
    assert np.array_equal(ours["numpy"][1], theirs["numpy"][1])
    with pytest.raises(RefusedFile, match=r"numpy\._core\.multiarray\._reconstruct.*not unpickle"):
        load(rng_file)  # NumPy arrays only where a caller asks for them

    resumed = {}
    for kind in (transformers.Trainer, hf.Trainer):
        trainer = _trainer(kind, tmp_path / kind.__module__, max_steps=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=str(written_by_transformers))
        resumed[kind] = trainer
    theirs, ours = resumed.values()
    assert ours.state.global_step == theirs.state.global_step == 4
    torch.testing.assert_close(ours.model.state_dict(), theirs.model.state_dict())


def test_numpy_names_cannot_allocate_an_array_of_a_shape_the_pickle_names():
    class ObjectDtype:  # dtype('O') without the state transformers' allowlist cannot build
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return (np.dtype, ("O8", False, True))

    reconstruct = np.empty(0).__reduce__()[0]
    for call in (_Runs(np.ndarray, (2**17,), ObjectDtype()),
                 _Runs(reconstruct, np.ndarray, (2**17,), ObjectDtype())):  # fmt: skip
        body = io.BytesIO()
        torch.save({"x": call}, body)
        assert len(body.getvalue()) < 4096
        with torch.serialization.safe_globals(_transformers_allowlist()):
            built = torch.load(io.BytesIO(body.getvalue()), weights_only=True)["x"]
        assert built.nbytes == 2**20  # a 1 MiB array from a pickle of a few hundred bytes
        with pytest.raises(RefusedFile, match=r"may only"):
            load(body.getvalue(), numpy_arrays=True)
    assert NUMPY_ARRAY_NAMES == (
        "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
        "numpy.dtypes.UInt32DType",
    )  # fmt: skip


def test_a_bytearray_of_a_size_the_pickle_names_is_refused():
    body = io.BytesIO()
    torch.save({"x": _Runs(bytearray, 2**20)}, body)
    assert len(torch.load(io.BytesIO(body.getvalue()), weights_only=True)["x"]) == 2**20
    with pytest.raises(RefusedFile, match=r"bytearray, which hookloop does not unpickle") as err:
        load(body.getvalue())
    copied = pickle.loads(pickle.dumps(err.value))  # as it crosses to a parent process
    assert str(copied) == str(err.value) and copied.reason == err.value.reason


def test_a_name_allowed_process_wide_by_other_code_is_still_refused():
    import argparse

    body = io.BytesIO()
    torch.save({"args": argparse.Namespace(lr=0.1)}, body)
    with torch.serialization.safe_globals([argparse.Namespace]):  # as any other code may
        assert torch.load(io.BytesIO(body.getvalue()), weights_only=True)["args"].lr == 0.1
        with pytest.raises(RefusedFile, match=r"argparse\.Namespace, which hookloop does not"):
            load(body.getvalue())
    with pytest.raises(RefusedFile, match=r"argparse\.Namespace, which hookloop does not"):
        load(body.getvalue())  # and by torch's own check when nobody allowed it


# -- zip bombs -------------------------------------------------------------------------
BOMB_BYTES = 64 * 2**20  # what the body inflates to under torch.load
CAP = 4 * 2**20


def _deflated(body: bytes) -> bytes:
    """``body`` (a torch.save archive) with its tensor entries deflated."""
    source, out = zipfile.ZipFile(io.BytesIO(body)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as rewritten:
        for entry in source.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in entry.filename else zipfile.ZIP_STORED
            rewritten.writestr(entry.filename, source.read(entry), compress_type=method)
    return out.getvalue()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A tensor body under 256 KiB that inflates to 64 MiB of zeros."""
    body = _deflated(save_tensors({"layer0.weight": torch.zeros(BOMB_BYTES // 4)}))
    assert len(body) < 256 * 2**10
    return body


def test_a_zip_bomb_inflates_under_torch_load_and_is_refused_before_torch_reads_it(
    bomb: bytes, monkeypatch: pytest.MonkeyPatch
):
    inflated = torch.load(io.BytesIO(bomb), weights_only=True)["layer0.weight"]
    assert inflated.nbytes == BOMB_BYTES  # the attack is live: 64 MiB from < 256 KiB
    del inflated
    reads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: reads.append(a))
    for cap in (CAP, None):
        with pytest.raises(RefusedFile) as refused:
            load(bomb, max_bytes=cap)
        assert str(refused.value) == (
            f"the body: entry archive/data/0 is compressed ({_size(bomb)} "
            f"bytes inflating to {BOMB_BYTES}); only entries stored uncompressed, as torch.save "
            "writes them, are read"
        )
    assert reads == []  # refused from the zip's directory: torch never read the body


def _size(body: bytes) -> int:
    return zipfile.ZipFile(io.BytesIO(body)).getinfo("archive/data/0").compress_size


def test_the_cap_and_a_lying_directory_are_refused_and_plain_bodies_load():
    body = save_tensors({"w": torch.arange(6.0)})
    assert torch.equal(load(body, max_bytes=len(body))["w"], torch.arange(6.0))
    with pytest.raises(RefusedFile, match=rf"it is {len(body)} bytes; at most 100 are read"):
        load(body, max_bytes=100)
    with pytest.raises(RefusedFile, match=r"not a torch.save zip archive"):
        load(b"\x80\x02}q\x00.")  # a bare pickle: the format before torch 1.6
    legacy = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(RefusedFile, match=r"not a torch.save zip archive"):
        load(legacy.getvalue())


def _post(address: str, route: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{address}/{route}", data=body, method="POST")
    request.add_header("Authorization", f"Bearer {TOKEN}")
    request.add_header("Content-Type", "application/octet-stream")
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_diloco_server_answers_a_zip_bomb_with_400_in_one_line(bomb: bytes, tmp_path: Path):
    storage.save_initial(tmp_path / "start", torch.nn.Linear(4, 4))
    server = DiLoCoServer(str(tmp_path / "out"), 1, str(tmp_path / "start"), port=0,
                          token=TOKEN, save_every_n_rounds=0).start()  # fmt: skip
    try:
        assert len(bomb) < server.max_payload_mb * 2**20  # within the body cap
        status, text = _post(server.address, "submit_pseudograd", _bomb_submission(bomb))
        error = json.loads(text)["error"]
        assert status == 400 and "\n" not in error
        assert "entry archive/data/0 is compressed" in error and str(BOMB_BYTES) in error
        assert server.status()["sync_round"] == 0  # nothing else happened
    finally:
        server.stop()


def _bomb_submission(bomb: bytes) -> bytes:
    header = pack({"worker_id": "w"}, {})
    head_length = 4 + int.from_bytes(header[:4], "big")
    return header[:head_length] + bomb


@pytest.fixture
def answering(bomb: bytes) -> Iterator[str]:
    """A server on 127.0.0.1 that answers every GET with the zip bomb."""

    class Bomb(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(bomb)))
            self.end_headers()
            self.wfile.write(bomb)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bomb)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_a_worker_refuses_a_zip_bomb_answer_naming_the_server(answering: str):
    client = DiLoCoClient(answering, timeout=20, max_retries=0)
    with pytest.raises(ValueError) as refused:
        client.get_global_params()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"DiLoCo server http://{answering} answered /global_params")
    assert "entry archive/data/0 is compressed" in message


def test_a_worker_reads_no_more_of_an_answer_than_its_cap(answering: str, bomb: bytes):
    client = DiLoCoClient(answering, timeout=20, max_retries=0, max_answer_bytes=1024)
    with pytest.raises(ValueError) as refused:
        client.get_global_params()
    assert str(refused.value) == (
        f"DiLoCo server http://{answering} answered /global_params with more than 1024 bytes, "
        "the most this client reads"
    )
    assert client.bytes_received == 1025 < len(bomb)


# -- one loader ------------------------------------------------------------------------
UNPICKLERS = {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
              ("np", "load"), ("numpy", "load"), ("torch.serialization", "load")}  # fmt: skip


def _unpickling_calls(source: str) -> list[int]:
    """Lines that call, or import, one of :data:`UNPICKLERS`."""

    def unpickles(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return (ast.unparse(node.value), node.attr) in UNPICKLERS
        if isinstance(node, ast.ImportFrom):
            return any((node.module, alias.name) in UNPICKLERS for alias in node.names)
        return False

    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if unpickles(node)})


def test_no_module_but_the_loader_unpickles():
    sample = "import torch\nfrom pickle import loads\nx = torch.load(f)\ny = np.load(g)\n"
    assert _unpickling_calls(sample) == [2, 3, 4]  # the search sees what it looks for
    found = {
        path.relative_to(SRC).as_posix(): lines
        for path in sorted(SRC.rglob("*.py"))
        if (lines := _unpickling_calls(path.read_text(encoding="utf-8")))
    }
    assert set(found) == {"safeload.py"}, f"unpickling outside hookloop.safeload: {found}"
